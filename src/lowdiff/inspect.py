"""Looking into a checkpoint directory without the training code: inspect, verify, export."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine.record import RecordLayout
from lowdiff.errors import CheckpointMismatchError, CorruptCheckpointError, RecoveryError
from lowdiff.format import codec, layout, sfile
from lowdiff.format.atomic import TMP_PREFIX
from lowdiff.recovery.replay import RecoveryStats, recover
from lowdiff.recovery.scan import (
    FileInfo,
    make_plan,
    recoverable_intervals,
    recoverable_range,
    scan,
)


@dataclass
class DirectoryInfo:
    """What a checkpoint directory holds."""

    root: Path
    manifest: dict[str, Any]
    full_checkpoints: list[FileInfo]
    record_files: list[FileInfo]
    recoverable: tuple[int, int] | None
    """(oldest, newest) recoverable step; see ``recoverable_intervals`` for gaps."""
    problems: list[tuple[Path, str]] = field(default_factory=list)
    recoverable_intervals: list[tuple[int, int]] = field(default_factory=list)
    """Every recoverable step lies in one of these inclusive intervals."""
    live_replica: dict[str, Any] | None = None
    """LowDiff+: the checkpointing process's replica in memory (pid, state, step), if any."""
    foreign: list[tuple[Path, str]] = field(default_factory=list)
    """Record files of another trajectory (see :mod:`lowdiff.recovery.scan`, "Lineage")
    that recovery to the newest step passes over: (path, why)."""

    @property
    def n_records(self) -> int:
        return sum(f.n_records for f in self.record_files)

    @property
    def bytes_per_record(self) -> float:
        """Mean bytes on disk per record (file overhead included)."""
        n = self.n_records
        return sum(f.nbytes for f in self.record_files) / n if n else 0.0

    @property
    def bytes_per_full(self) -> float:
        """Mean bytes of the full checkpoints taken after optimizer state exists."""
        sized = [f.nbytes for f in self.full_checkpoints if f.first_step > 0] or [
            f.nbytes for f in self.full_checkpoints
        ]
        return sum(sized) / len(sized) if sized else 0.0

    @property
    def n_parameters(self) -> int:
        rl = self.manifest["record_layout"]
        total = 0
        for _, _, shape, _ in rl["params"]:
            n = 1
            for s in shape:
                n *= int(s)
            total += n
        return total


def inspect_dir(path: str | Path) -> DirectoryInfo:
    """Summarise a checkpoint directory (headers only; see :func:`verify_dir` for checksums).

    Example:
        >>> info = lowdiff.inspect_dir("runs/ckpt")  # doctest: +SKIP
        >>> info.recoverable  # doctest: +SKIP
        (0, 240)
    """
    from lowdiff.engine.replica import replica_status

    sc = scan(path)
    try:
        foreign = [(x.file.path, x.describe()) for x in make_plan(sc, None).foreign]
    except RecoveryError:
        foreign = []  # nothing recoverable: ``recoverable`` says so
    return DirectoryInfo(
        sc.root,
        sc.manifest,
        sc.fulls,
        sc.records,
        recoverable_range(sc),
        sc.problems,
        recoverable_intervals(sc),
        replica_status(sc.root),
        foreign,
    )


@dataclass
class JobInfo:
    """What a distributed job's checkpoint directory holds (one shard per rank)."""

    root: Path
    manifest: dict[str, Any]
    shards: list[DirectoryInfo]
    recoverable_intervals: list[tuple[int, int]]
    """Steps every shard can serve from a common full checkpoint (what a resume agrees on)."""

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def recoverable(self) -> tuple[int, int] | None:
        iv = self.recoverable_intervals
        return (iv[0][0], iv[-1][1]) if iv else None


def inspect_job(path: str | Path) -> JobInfo:
    """Summarise a distributed job's directory: every shard, and the steps all of them serve."""
    from lowdiff.dist.recovery import shard_scans
    from lowdiff.recovery.scan import chain_from, usable

    root = Path(path)
    manifest = layout.read_manifest(root)
    scans = shard_scans(root, int(manifest["world_size"]))
    common = set.intersection(
        *({f.first_step for f in sc.fulls if f.path not in usable(sc)} for sc in scans)
    )
    spans = sorted((f, min(chain_from(sc, f)[0] for sc in scans)) for f in common)
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return JobInfo(root, manifest, [inspect_dir(sc.root) for sc in scans], merged)


def is_job(path: str | Path) -> bool:
    """True when ``path`` is the root of a distributed job's checkpoint directory."""
    from lowdiff.dist.recovery import is_job_dir

    return is_job_dir(Path(path))


def verify_dir(path: str | Path) -> tuple[int, list[tuple[Path, str]]]:
    """Check every checksum in the directory (every shard, for a distributed job).

    Returns:
        (number of files checked, [(path, reason) for every bad file]).
    """
    root = Path(path)
    from lowdiff.baselines.base import is_baseline_dir, verify_baseline_dir

    if is_baseline_dir(root):  # a baseline strategy's directory: commit files, not sfiles
        return verify_baseline_dir(root)
    if is_job(root):
        from lowdiff.dist.context import rank_dir

        n_checked, bad_shards = 1, []
        for r in range(int(layout.read_manifest(root)["world_size"])):
            d = rank_dir(root, r)
            if not (d / layout.MANIFEST).exists():
                bad_shards.append((d, "shard directory missing or without a manifest"))
                continue
            n, b = verify_dir(d)
            n_checked += n
            bad_shards.extend(b)
        return n_checked, bad_shards
    bad: list[tuple[Path, str]] = []
    checked = 1
    try:
        layout.read_manifest(root)
    except CorruptCheckpointError as e:
        bad.append((e.path, e.reason))
    sc_problems: list[tuple[Path, str]] = []
    try:
        sc = scan(root)
        sc_problems = sc.problems
        files = [f.path for f in sc.fulls + sc.records]
    except CorruptCheckpointError:
        files = [
            p
            for d in (layout.FULL_DIR, layout.RECORDS_DIR)
            for p in sorted((root / d).glob("*"))
            if not p.name.startswith(TMP_PREFIX)
        ]
    bad.extend(sc_problems)
    seen = {p for p, _ in bad}
    for p in files:
        if p in seen:
            continue
        checked += 1
        try:
            sfile.verify(p)
        except CorruptCheckpointError as e:
            bad.append((e.path, e.reason))
    checked += len(sc_problems)
    return checked, bad


def _set_path(
    root: torch.nn.Module, name: str, value: torch.Tensor | torch.nn.Parameter, is_param: bool
) -> None:
    *parents, leaf = name.split(".")
    mod = root
    for part in parents:
        child = getattr(mod, part, None) if part in mod._modules else None
        if child is None:
            child = torch.nn.Module()
            mod.add_module(part, child)
        mod = child
    if is_param:
        mod.register_parameter(leaf, value)  # type: ignore[arg-type]
    else:
        mod.register_buffer(leaf, value)


def _optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    module, _, cls = name.rpartition(".")
    if not (module == "torch.optim" or module.startswith("torch.optim.")):
        raise CheckpointMismatchError(
            f"this checkpoint was written with optimizer {name}; export without the training code supports "
            "torch.optim optimizers only (use lowdiff.restore with your own model and optimizer)"
        )
    obj = getattr(importlib.import_module(module), cls, None)
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise CheckpointMismatchError(f"{name} is not a torch.optim optimizer")
    return obj


def rebuild(
    path: str | Path, step: int | None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, RecoveryStats]:
    """Rebuild a stand-in model and optimizer from the checkpoint alone and restore ``step``."""
    root = Path(path)
    sc = scan(root)
    plan = make_plan(sc, step)
    lf = sfile.read(plan.full.path)
    md = lf.metadata
    rl = RecordLayout.from_json(sc.manifest["record_layout"])
    aliases = json.loads(md["model_aliases"])
    msd = {k[len("model/") :]: v.clone() for k, v in lf.tensors.items() if k.startswith("model/")}
    bnames = {n for n, _, _ in rl.buffers}
    model = torch.nn.Module()
    params: dict[str, torch.nn.Parameter] = {}
    for name, t in msd.items():
        if name in bnames:
            _set_path(model, name, t, False)
        else:  # optimized, or frozen (in the state dict but not in the optimizer)
            params[name] = torch.nn.Parameter(t, requires_grad=t.is_floating_point())
            _set_path(model, name, params[name], True)
    for alias, canon in aliases.items():
        _set_path(model, alias, params[canon], canon in params)
    osd = codec.loads(md["optim"], lambda n: lf.tensors[n].clone())
    cls = _optimizer_class(sc.manifest["optimizer"])
    ordered = [params[p.name] for p in rl.params]
    groups = []
    for g in osd["param_groups"]:
        hp = {k: v for k, v in g.items() if k != "params"}
        groups.append({"params": [ordered[i] for i in g["params"]], **hp})
    optimizer = cls(groups)  # type: ignore[call-arg]  # torch.optim classes default their hyperparameters
    stats = recover(root, model, optimizer, None, step)
    return model, optimizer, stats


def export(path: str | Path, step: int | None, out: str | Path) -> int:
    """Write the model state at ``step`` (None: newest) as a plain safetensors file.

    Returns:
        The exported step.
    """
    model, _, stats = rebuild(path, step)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sfile.write_tensors(out, sd, {"kind": "export", "step": str(stats.step)})
    return stats.step
