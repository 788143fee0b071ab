"""Loading a full state into the live objects: the first half of every recovery.

A full state is a full checkpoint's tensors and metadata, read from its file
(:func:`load_full`) or handed over from a surviving process's memory (LowDiff+'s replica,
a distributed job's shards merged: :func:`apply_full_state`). It sets the model's
parameters and buffers, the optimizer's state, the scheduler, the extra state and the RNG
streams as they were at its step; the records after it are then replayed on top
(:mod:`lowdiff.recovery.replay`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Iterator
from typing import Any

import torch

from lowdiff.errors import CheckpointMismatchError, CorruptCheckpointError
from lowdiff.format import codec, sfile
from lowdiff.recovery.scan import FileInfo
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state import capture as st
from lowdiff.state.sharded import shard_model_state, shard_optimizer_state


def load_full(
    info: FileInfo,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    stats: RecoveryStats,
    *,
    restore_rng: bool = True,
) -> None:
    """Verify a full checkpoint and load it into the live objects."""
    t0 = time.perf_counter()
    raw = sfile.read_raw(info.path)
    t1 = time.perf_counter()
    lf = sfile.decode(info.path, raw)
    if (lf.metadata.get("run_id") or None) != info.run_id:
        raise CorruptCheckpointError(info.path, "the file changed since the directory was scanned")
    stats.read_s += t1 - t0
    stats.bytes_read += len(raw)
    stats.files_read += 1
    apply_full_state(
        lf.tensors,
        lf.metadata,
        model,
        optimizer,
        scheduler,
        stats,
        where=info.path.name,
        restore_rng=restore_rng,
    )


def apply_full_state(
    tensors: dict[str, torch.Tensor],
    md: dict[str, str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    stats: RecoveryStats,
    *,
    where: str,
    restore_rng: bool = True,
) -> None:
    """Load a full state (tensors + metadata, from a file or from the replica in memory).

    The copies run on one thread (:func:`one_copy_thread`): they are memory-bound, and a
    parallel copy stalls whenever a background process (the one the state comes from,
    busy answering the new trainer) holds one of the cores its threads wait for."""
    t1 = time.perf_counter()
    aliases = json.loads(md["model_aliases"])
    msd = {
        st.canonical_name(k[len("model/") :]): v
        for k, v in tensors.items()
        if k.startswith("model/")
    }
    for alias, canon in aliases.items():
        msd[st.canonical_name(alias)] = msd[st.canonical_name(canon)]
    with one_copy_thread():
        osd = codec.loads(md["optim"], lambda name: tensors[name].clone())
        sched_state = codec.loads(md["scheduler"])
        t2 = time.perf_counter()
        target = st.unwrap_model(model)
        msd = shard_model_state(msd, target)
        try:
            target.load_state_dict(msd, strict=True)
        except RuntimeError as e:
            raise CheckpointMismatchError(
                f"{where}: the model does not match the checkpoint: {e}"
            ) from None
        try:
            osd = shard_optimizer_state(st.match_param_layout(osd, optimizer), optimizer)
            optimizer.load_state_dict(osd)
        except (ValueError, KeyError) as e:
            raise CheckpointMismatchError(
                f"{where}: the optimizer does not match the checkpoint: {e}"
            ) from None
    load_scheduler(scheduler, sched_state, where)
    stats.extra = json.loads(md["extra"]) if "extra" in md else None
    if restore_rng:
        st.restore_rng(
            {k: v for k, v in tensors.items() if k.startswith("rng.")}, json.loads(md["rng"])
        )
    t3 = time.perf_counter()
    stats.decode_s += t2 - t1
    stats.replay_s += t3 - t2


def load_scheduler(scheduler: Any | None, state: Any, where: str) -> None:
    """Load ``state`` (a full checkpoint's or a record's) into ``scheduler``, if one was
    passed; a scheduler without a state to load is a mismatch."""
    if scheduler is None:
        return
    if state is None:
        raise CheckpointMismatchError(
            f"{where}: a scheduler was passed, but the checkpoint holds no scheduler state"
        )
    scheduler.load_state_dict(state)


@functools.cache
def _openmp_backend() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def one_copy_thread() -> Iterator[None]:
    """Run the block with one intra-op thread, then restore the caller's count.

    For copies only: a copy's result does not depend on the thread count, whereas an
    optimizer step's reductions may, so replay never runs under it. Measured on 2 cores
    (``benchmarks/first_steps.py``): the optimizer state of a 3.3M-parameter model cloned
    out of a surviving replica took 2 to 50 ms with 2 threads, 3 to 12 ms with one."""
    n = torch.get_num_threads()
    if n == 1 or not _openmp_backend():
        yield  # ATen's native thread pool cannot be resized once it ran (it would warn)
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
