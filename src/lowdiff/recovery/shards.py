"""Recovery of the shards of one generation of a distributed job at one agreed step.

Every rank scans every shard directory (``rank-NNNNN/``, headers only), computes the
newest step that every shard can reach from a common full checkpoint (:func:`plan_sharded`),
and the ranks take the minimum over all of them, so they agree even if one rank's
checkpointing process published a file after another rank looked. Each rank then reads
the full checkpoint of every shard (parameters and optimizer state of the shard; its own
shard also gives its buffers, RNG and scheduler) and replays the records of every shard:
the gradient of each parameter comes from the shard that owns it, and its own records
restore its per-rank state. At the end the ranks check that they reached the same step.

Lineage is checked per shard: each rank's files name its own session's run, so a shard's
chain takes only record files that follow the state it has reached (see
:mod:`lowdiff.recovery.scan`), and the agreed step is one every shard reaches that way.

Which generation to recover from, and the agreement itself, are
:mod:`lowdiff.recovery.job`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import torch

from lowdiff.compressors.base import compressor_from_spec
from lowdiff.ddp.shard import merge_state_dicts
from lowdiff.errors import CorruptCheckpointError, RecoveryError
from lowdiff.format import codec, layout, sfile
from lowdiff.recovery.compat import check_compatible_sharded
from lowdiff.recovery.full_state import apply_full_state
from lowdiff.recovery.replay import (
    pass_over_full,
    replay_records,
    state_run,
    warn_damaged,
    warn_foreign,
)
from lowdiff.recovery.scan import (
    FileInfo,
    Foreign,
    Scan,
    abandoned,
    chain_from,
    merge_intervals,
    passed_over,
    scan,
    search_chain,
    usable,
)
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state import capture as st
from lowdiff.state.record import RecordLayout


def scan_dirs(root: Path, dirs: list[Path]) -> list[Scan]:
    """Scan the shard directories ``dirs`` of ``root``; raise naming those without a manifest."""
    world_size = len(dirs)
    missing = [d.name for d in dirs if not (d / layout.MANIFEST).exists()]
    if missing:
        raise RecoveryError(
            f"{root}: shard directories without a manifest: {', '.join(missing)}; a distributed "
            f"checkpoint needs all {world_size} shards"
        )
    return [scan(d) for d in dirs]


def plan_sharded(
    scans: list[Scan], target: int | None, bad: AbstractSet[Path] = frozenset()
) -> tuple[int, int]:
    """(target step, full-checkpoint step) that every shard can serve."""
    steps = [{f.first_step for f in sc.fulls if f.path not in usable(sc, bad)} for sc in scans]
    common = set.intersection(*steps) if steps else set()
    if not common:
        raise RecoveryError(
            f"{scans[0].root.parent}: no full checkpoint is present and intact in every shard"
        )
    options = [(min(chain_from(sc, f, bad)[0] for sc in scans), f) for f in sorted(common)]
    if target is None:
        reach, f = max(options)
        return reach, f
    fits = [f for reach, f in options if f <= target <= reach]
    if not fits:
        have = ", ".join(f"{lo}..{hi}" for lo, hi in merge_intervals((f, r) for r, f in options))
        raise RecoveryError(
            f"{scans[0].root.parent}: step {target} is not recoverable in every shard; "
            f"recoverable: {have or 'nothing'}"
        )
    return target, max(fits)


def shard_files(
    sc: Scan, full: int, target: int, bad: AbstractSet[Path]
) -> tuple[FileInfo, list[FileInfo], list[Foreign]]:
    """A shard's full checkpoint at ``full``, its record files up to ``target``, and the
    files of another trajectory its chain passed over on the way."""
    gone = abandoned(sc, bad)
    out = usable(sc, bad)
    f = next(x for x in sc.fulls if x.first_step == full and x.path not in out)
    c = search_chain(sc, full, f.run_id, out)
    files = [r for r in c.files if r.first_step < target]
    return f, files, passed_over(gone, c, full, target)


def _cloner(tensors: dict[str, torch.Tensor]) -> Any:
    return lambda name: tensors[name].clone()


def load_full_sharded(
    fulls: list[FileInfo],
    own: int,
    model: Any,
    optimizer: Any,
    scheduler: Any | None,
    stats: RecoveryStats,
) -> None:
    """Verify every shard's full checkpoint and load their union into the live objects."""
    parts = []
    for info in fulls:
        t0 = time.perf_counter()
        raw = sfile.read_raw(info.path)
        stats.read_s += time.perf_counter() - t0
        stats.bytes_read += len(raw)
        stats.files_read += 1
        lf = sfile.decode(info.path, raw)
        if not isinstance(codec.loads(lf.metadata.get("shard", "null")), list):
            raise CorruptCheckpointError(info.path, "no shard list in a distributed checkpoint")
        parts.append((lf.tensors, lf.metadata))
    apply_sharded_state(parts, own, model, optimizer, scheduler, stats, where=fulls[own].path.name)


def apply_sharded_state(
    parts: list[tuple[dict[str, torch.Tensor], dict[str, str]]],
    own: int,
    model: Any,
    optimizer: Any,
    scheduler: Any | None,
    stats: RecoveryStats,
    *,
    where: str,
) -> None:
    """Load the union of every shard's full state (from files or from the replicas).

    Parameters and optimizer state come from the shard that owns them; buffers, RNG and
    scheduler from shard ``own`` (this rank's).
    """
    param_names = {info.name for info, _ in st.optimizer_params(model, optimizer)}
    tensors: dict[str, torch.Tensor] = {}
    osds = []
    for s, (ts, md) in enumerate(parts):
        shard = codec.loads(md["shard"])
        osds.append((codec.loads(md["optim"], _cloner(ts)), shard))
        for k, v in ts.items():
            if s == own:
                if not k.startswith("optim/"):
                    tensors[k] = v
            elif k.startswith("model/") and k[len("model/") :] in param_names:
                tensors[k] = v
    otensors, ojson = st.optimizer_state_tensors(optimizer, merge_state_dicts(osds, own))
    md = dict(parts[own][1])
    md["optim"] = ojson
    tensors.update(otensors)
    apply_full_state(tensors, md, model, optimizer, scheduler, stats, where=where)


def recover_shards(
    root: Path,
    dirs: list[Path],
    own: int,
    model: Any,
    optimizer: Any,
    scheduler: Any | None,
    step: int | None,
    agree_min: Callable[[int], int],
    agree: Callable[[int, str], int],
) -> RecoveryStats:
    """Load every shard's state at one step into the live objects (``own``: this rank's
    per-rank state); ``agree_min`` / ``agree`` make the ranks of a job settle on one step
    (identities in a single process)."""
    t_start = time.perf_counter()
    scans = scan_dirs(root, dirs)
    skipped = warn_damaged([pw for sc in scans for pw in sc.problems])
    rls = [RecordLayout.from_json(sc.manifest["record_layout"]) for sc in scans]
    check_compatible_sharded(rls, [sc.manifest for sc in scans], model, optimizer, scheduler)
    compressor = compressor_from_spec(scans[own].manifest["compressor"])
    bad: set[Path] = set()
    while True:
        try:
            local_target, _ = plan_sharded(scans, step, bad)
        except RecoveryError as e:
            if not bad:
                raise
            damaged = "; ".join(f"{Path(p).name}: {why}" for p, why in skipped)
            raise RecoveryError(f"{e} (damaged: {damaged})") from None
        target = agree_min(local_target)
        target, full = plan_sharded(scans, target, bad)
        agree(full, "the full checkpoint to start from")
        picked = [shard_files(sc, full, target, bad) for sc in scans]
        stats = RecoveryStats(full_step=full, step=full)
        try:
            load_full_sharded([f for f, _, _ in picked], own, model, optimizer, scheduler, stats)
        except CorruptCheckpointError as e:
            pass_over_full(e, bad, skipped)
            continue
        stats.skipped += warn_foreign([x for _, _, foreign in picked for x in foreign])
        replay_records(
            [(rl, files) for rl, (_, files, _) in zip(rls, picked, strict=True)],
            own,
            full,
            target,
            model,
            optimizer,
            scheduler,
            compressor,
            stats,
            strict=step is not None,
        )
        agree(stats.step, "the recovered step")
        own_full, own_files, _ = picked[own]
        stats.state_run_id = state_run(own_full, own_files, stats.step)
        stats.skipped = skipped + stats.skipped
        stats.total_s = time.perf_counter() - t_start
        return stats
