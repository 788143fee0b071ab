"""Recovery: replay records through the user's optimizer, on top of a full state.

The full state is loaded first (:mod:`lowdiff.recovery.full_state`); :func:`replay` does
both for a single process's directory, :func:`replay_records` the records of every shard
of a distributed job.

Replay of a model on a GPU is pipelined: a reader thread reads, verifies and decodes the
next record files (and decompresses their gradients) while the main thread runs
``optimizer.step()`` on the current one. On the CPU the two would only share the cores
and the interpreter, and the thread made recovery slower (20 records of a 0.12 M-parameter
model replayed in 57 to 82 ms with it, 38 to 49 ms without, on 2 cores): there the same
reader runs inline, each record read and decoded just before its step. The split of the time into read, decode and replay is
reported in :class:`RecoveryStats` (with the thread the three overlap, so they add up to
more than ``total_s``).

Nothing is loaded before its checksum is verified. When a record file turns out to be
damaged, recovery to "the newest step" stops at the last intact record and warns;
recovery to an explicit step raises :class:`RecoveryError`. Record files of another
trajectory (see :mod:`lowdiff.recovery.scan`, "Lineage") are never chained: recovery
passes them over with a :class:`RecoveryWarning` naming the file and both runs.

The entry points that pick between this single-directory recovery and a distributed
job's (:mod:`lowdiff.recovery.job`) are in :mod:`lowdiff.recovery.restore`.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
import warnings
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import torch

from lowdiff.compressors.base import Compressor, compressor_from_spec
from lowdiff.errors import CorruptCheckpointError, RecoveryError, RecoveryWarning
from lowdiff.format import codec, layout, sfile
from lowdiff.recovery.compat import check_compatible
from lowdiff.recovery.full_state import (
    apply_full_state as apply_full_state,  # re-exported: lowdiff.engine imports it from here
)
from lowdiff.recovery.full_state import load_full, load_scheduler
from lowdiff.recovery.scan import FileInfo, Foreign, Plan, Scan
from lowdiff.recovery.stats import RecoveryStats as RecoveryStats
from lowdiff.state import capture as st
from lowdiff.state.record import RecordLayout

_END = object()
_REPLAY = threading.local()


def replaying() -> bool:
    """Whether this thread is inside a recovery's ``optimizer.step()`` (a replay)."""
    return getattr(_REPLAY, "active", False)


def iter_rows(
    files: list[FileInfo],
    rl: RecordLayout,
    layout_id: str,
    start: int,
    end: int,
    stats: RecoveryStats,
) -> Iterator[tuple[int, dict[str, Any], dict[str, torch.Tensor]]]:
    """Read, verify and decode record files; yield ``(step, meta, views)`` for ``start <= step < end``.

    Raises :class:`CorruptCheckpointError` at the first damaged file (after yielding every
    record before it).
    """
    for f in files:
        t0 = time.perf_counter()
        raw = sfile.read_raw(f.path)
        t1 = time.perf_counter()
        lf = sfile.decode(f.path, raw)
        if lf.metadata.get("layout_id") != layout_id:
            raise CorruptCheckpointError(f.path, "record layout differs from the manifest's")
        if (lf.metadata.get("run_id") or None, lf.metadata.get("follows") or None) != (
            f.run_id,
            f.follows,
        ):
            raise CorruptCheckpointError(f.path, "the file changed since the directory was scanned")
        metas = json.loads(lf.metadata["records_meta"])
        rows = lf.tensors["records"]
        if len(metas) != f.n_records or tuple(rows.shape) != (f.n_records, rl.row_bytes):
            raise CorruptCheckpointError(f.path, "record table has the wrong shape")
        stats.read_s += t1 - t0
        stats.bytes_read += len(raw)
        stats.files_read += 1
        for j in range(f.n_records):
            step = f.first_step + j
            if step < start or step >= end:
                continue
            meta = codec.decode(metas[j])
            if meta["step"] != step:
                raise CorruptCheckpointError(
                    f.path, f"record {j} says step {meta['step']}, expected {step}"
                )
            yield step, meta, rl.views(rows[j])


def decompress_grads(
    rl: RecordLayout,
    comp: Compressor,
    views: dict[str, torch.Tensor],
    nograd: set[int],
    devices: dict[int, torch.device],
) -> dict[int, torch.Tensor | None]:
    """The dense gradients of one record, by parameter index, on their parameters' devices:
    those of one dtype and device decoded together (:meth:`Compressor.decompress_many`)
    and moved to their device in one copy."""
    out: dict[int, torch.Tensor | None] = {}
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for k, p in enumerate(rl.params):
        if p.index in nograd:
            out[p.index] = None
        else:
            groups.setdefault((p.dtype, devices[p.index]), []).append(k)
    for (dtype, device), ks in groups.items():
        params = [rl.params[k] for k in ks]
        numels = [math.prod(p.shape) for p in params]
        flat = comp.decompress_many([rl.payload(views, k) for k in ks], numels, dtype)
        flat = flat.to(device, non_blocking=True)
        for p, g in zip(params, flat.split(numels), strict=True):
            out[p.index] = g.view(p.shape)
    return out


READ_AHEAD_BYTES = 256 << 20
"""How many bytes of decoded gradients recovery's reader may hold ahead of replay (at
least one record, at most :data:`READ_AHEAD_RECORDS`): the dense gradients of the
records queued live on the parameters' devices, so a model of 64M parameters or more is
replayed one decoded record ahead instead of eight, and its recovery needs a gradient's
worth of memory or two beside the model, as its training does."""
READ_AHEAD_RECORDS = 8


def read_ahead(sources: list[tuple[RecordLayout, list[FileInfo]]]) -> int:
    """Records the reader decodes ahead of replay for these record layouts."""
    dense = sum(math.prod(p.shape) * p.dtype.itemsize for rl, _ in sources for p in rl.params)
    return max(1, min(READ_AHEAD_RECORDS, READ_AHEAD_BYTES // max(1, dense)))


def reader_thread(devices: dict[int, torch.device]) -> bool:
    """Whether replay reads and decodes the records on a thread of its own: when a
    parameter lives on an accelerator (see the module docstring)."""
    return any(d.type != "cpu" for d in devices.values())


class _Reader(threading.Thread):
    """Reads, verifies and decodes records ahead of replay.

    ``sources`` holds one ``(record layout, files)`` per shard (one for a single-process
    directory); ``own`` is the shard whose metadata and per-rank state (buffers, RNG)
    the records restore. Every record step must be present in every shard.
    """

    def __init__(
        self,
        sources: list[tuple[RecordLayout, list[FileInfo]]],
        own: int,
        start: int,
        end: int,
        compressor: Compressor,
        devices: dict[int, torch.device],
        stats: RecoveryStats,
    ) -> None:
        super().__init__(daemon=True, name="lowdiff-recovery-reader")
        self.sources, self.own, self.start_step, self.end_step = sources, own, start, end
        self.comp, self.devices, self.stats = compressor, devices, stats
        self.q: queue.Queue[Any] = queue.Queue(maxsize=read_ahead(sources))
        self.stop = threading.Event()

    def run(self) -> None:
        for item in self.items():
            self.q.put(item)

    def items(self) -> Generator[Any, None, None]:
        """What the reader produces, in order: ``("record", step, grads, meta, views)``
        per record, then :data:`_END`; or, last, ``("corrupt", error)`` at a damaged file
        or ``("error", exception)``. Runs on the thread, or inline (:func:`replay_records`)."""
        try:
            its = [
                iter_rows(files, rl, rl.layout_id, self.start_step, self.end_step, self.stats)
                for rl, files in self.sources
            ]
            while not self.stop.is_set():
                rows = []
                try:
                    for it in its:
                        rows.append(next(it, None))
                except CorruptCheckpointError as e:
                    yield ("corrupt", e)
                    return
                if all(r is None for r in rows):
                    break
                if any(r is None for r in rows) or len({r[0] for r in rows if r}) != 1:
                    raise RecoveryError(
                        "the shards' record chains disagree: "
                        + ", ".join(str(r[0]) if r else "end" for r in rows)
                    )
                t2 = time.perf_counter()
                step, meta, views = rows[self.own]  # type: ignore[misc]
                grads: dict[int, torch.Tensor | None] = {}
                for (rl, _), row in zip(self.sources, rows, strict=True):
                    assert row is not None
                    grads.update(
                        decompress_grads(rl, self.comp, row[2], set(row[1]["nograd"]), self.devices)
                    )
                self.stats.decode_s += time.perf_counter() - t2
                yield ("record", step, grads, meta, views)
            yield _END
        except GeneratorExit:
            raise  # inline, closed by its consumer
        except BaseException as e:  # noqa: BLE001 -- re-raised on the main thread
            yield ("error", e)


def replay(
    root: Path,
    sc: Scan,
    plan: Plan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    *,
    strict: bool,
) -> RecoveryStats:
    """Load ``plan.full`` and replay its records; see the module docstring."""
    t_start = time.perf_counter()
    manifest = sc.manifest
    rl = check_compatible(manifest, model, optimizer, scheduler)
    compressor = compressor_from_spec(manifest["compressor"])
    stats = RecoveryStats(full_step=plan.full.first_step, step=plan.full.first_step)
    load_full(plan.full, model, optimizer, scheduler, stats)
    stats.skipped += warn_foreign(plan.foreign)
    replay_records(
        [(rl, plan.record_files)],
        0,
        plan.full.first_step,
        plan.target,
        model,
        optimizer,
        scheduler,
        compressor,
        stats,
        strict=strict,
    )
    stats.state_run_id = state_run(plan.full, plan.record_files, stats.step)
    stats.total_s = time.perf_counter() - t_start
    return stats


def state_run(full: FileInfo, files: list[FileInfo], step: int) -> str | None:
    """The run that produced the state at ``step``, reached from ``full`` through ``files``
    (the chain's files in order: the first that holds record ``step - 1`` replayed it)."""
    if step > full.first_step:
        for f in files:
            if f.first_step <= step - 1 <= f.last_step:
                return f.run_id
    return full.run_id


def warn_foreign(foreign: list[Foreign]) -> list[tuple[str, str]]:
    """Warn about each file of another trajectory a plan left out; returns them as
    ``(path, reason)``."""
    for x in foreign:
        warnings.warn(f"lowdiff: {x.describe()}", RecoveryWarning, stacklevel=4)
    return [(str(x.file.path), x.reason) for x in foreign]


def replay_records(
    sources: list[tuple[RecordLayout, list[FileInfo]]],
    own: int,
    start: int,
    target: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    compressor: Compressor,
    stats: RecoveryStats,
    *,
    strict: bool,
) -> None:
    """Replay records ``start .. target-1`` through ``optimizer`` (the full state is loaded).

    ``sources`` is one ``(layout, files)`` per shard; the gradient of each parameter comes
    from the shard that holds it, and the per-rank state (buffers, RNG, scheduler) from
    shard ``own``. Sets ``stats.step`` to the step reached.
    """
    stats.step = start
    if target == start:
        return
    t0 = time.perf_counter()
    live = [p for _, p in st.optimizer_params(model, optimizer)]
    devices = {i: p.device for i, p in enumerate(live)}
    reader = _Reader(sources, own, start, target, compressor, devices, stats)
    threaded = reader_thread(devices)
    inline = reader.items()
    items: Iterator[Any] = iter(reader.q.get, None) if threaded else inline
    if threaded:
        reader.start()
    try:
        expected, last = _replay_queued(items, live, optimizer, start, target, stats, strict)
    finally:
        reader.stop.set()
        inline.close()
        if threaded:
            # unblock the reader if it is waiting on a full queue
            while reader.is_alive():
                try:
                    reader.q.get_nowait()
                except queue.Empty:
                    reader.join(0.05)
    for p in live:
        p.grad = None
    if last is not None:
        _apply_record_state(sources[own][0], *last, model, optimizer, scheduler, stats)
    stats.step = expected
    stats.records_s += time.perf_counter() - t0


def _replay_queued(
    items: Iterator[Any],
    live: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    start: int,
    target: int,
    stats: RecoveryStats,
    strict: bool,
) -> tuple[int, tuple[dict[str, Any], dict[str, torch.Tensor]] | None]:
    """Run ``optimizer.step()`` on each record of ``items`` (:meth:`_Reader.items`), until
    its end or a damaged file; returns the step reached and the last replayed record's
    ``(meta, views)`` (None when none was)."""
    last: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
    expected = start
    for item in items:
        if item is _END:
            break
        if item[0] == "error":
            raise item[1]
        if item[0] == "corrupt":
            err: CorruptCheckpointError = item[1]
            if strict:
                raise RecoveryError(f"cannot reach step {target}: {err}") from err
            stats.skipped.append((str(err.path), err.reason))
            # stacklevel 5: the caller of recover(), through replay_records() and replay()
            warnings.warn(
                f"lowdiff: {err.path} is damaged ({err.reason}); recovering to step {expected}, "
                f"the last step before it",
                RecoveryWarning,
                stacklevel=5,
            )
            break
        _, step, grads, meta, views = item
        if step != expected:
            raise RecoveryError(f"record chain broken: expected step {expected}, got {step}")
        t0 = time.perf_counter()
        for i, p in enumerate(live):
            g = grads[i]
            # the gradient gets its parameter's strides, as in training (fused
            # kernels read memory in layout order)
            p.grad = g if g is None or p.is_contiguous() else torch.empty_like(p).copy_(g)
        st.apply_hparams(optimizer, codec.decode(meta["hp"]))
        _REPLAY.active = True  # hooks lowdiff.attach installed must not record replays
        try:
            optimizer.step()
        finally:
            _REPLAY.active = False
        stats.replay_s += time.perf_counter() - t0
        last = (meta, views)
        expected += 1
        stats.records_replayed += 1
    return expected, last


def _apply_record_state(
    rl: RecordLayout,
    meta: dict[str, Any],
    views: dict[str, torch.Tensor],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    stats: RecoveryStats,
) -> None:
    """Restore what a record holds beside its gradient, as it was after its step:
    hyperparameters, buffers, scheduler, extra state and RNG streams."""
    t0 = time.perf_counter()
    st.apply_hparams(optimizer, codec.decode(meta["hp_after"]))
    st.set_buffers(model, rl.buffer_values(views))
    load_scheduler(scheduler, codec.decode(meta["sched"]), "record")
    stats.extra = meta.get("extra")
    st.restore_rng(rl.rng_tensors(views), meta["rng"])
    stats.replay_s += time.perf_counter() - t0


def warn_damaged(
    problems: list[tuple[Path, str]], step: int | None = None
) -> list[tuple[str, str]]:
    """Warn about each damaged file a scan found that a recovery to ``step`` (None: the
    newest) could have used; returns them as ``(path, reason)``."""
    problems = [(p, why) for p, why in problems if step is None or _may_serve(p, step)]
    for p, why in problems:
        warnings.warn(
            f"lowdiff: passing over damaged file {p}: {why}", RecoveryWarning, stacklevel=4
        )
    return [(str(p), why) for p, why in problems]


def _may_serve(p: Path, step: int) -> bool:
    """Whether the file at ``p`` could serve a recovery to ``step``, by its name: a full
    checkpoint at or before it, a record file from before it (any other name: yes)."""
    full = layout.parse_full_name(p.name)
    if full is not None:
        return full <= step
    rec = layout.parse_records_name(p.name)
    return rec is None or rec[0] < step


def pass_over_full(
    err: CorruptCheckpointError, bad: set[Path], skipped: list[tuple[str, str]]
) -> None:
    """A full checkpoint turned out damaged: warn, and leave it out of the next plan."""
    warnings.warn(
        f"lowdiff: {err}; falling back to an older full checkpoint", RecoveryWarning, stacklevel=4
    )
    bad.add(err.path)
    skipped.append((str(err.path), err.reason))
