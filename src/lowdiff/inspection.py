"""Looking into a checkpoint directory without the training code: inspect, verify, export.

Each accepts a single-process directory and a distributed job's (every shard, any world
size); export itself lives in :mod:`lowdiff.exporting`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowdiff.errors import CorruptCheckpointError, NotACheckpointDirectoryError, RecoveryError
from lowdiff.exporting import export as _export
from lowdiff.exporting import rebuild as _rebuild
from lowdiff.format import layout, sfile
from lowdiff.format.atomic import TMP_PREFIX
from lowdiff.methods import directory_kind
from lowdiff.proc.holder import replica_status
from lowdiff.recovery.job import generation_intervals
from lowdiff.recovery.job_layout import Generation, generations, is_job_dir
from lowdiff.recovery.scan import (
    FileInfo,
    make_plan,
    merge_intervals,
    recoverable_intervals,
    recoverable_range,
    scan,
)
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state.sharded import FSDP2


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


def inspect_dir(directory: str | Path, *, verify: bool = False) -> DirectoryInfo:
    """Summarise a checkpoint directory.

    By default from the files' headers alone: fast whatever the size of the checkpoints,
    and a file whose data section was damaged after it was written (a flipped byte) still
    counts, so the recoverable steps are those the headers promise. ``verify=True`` reads
    every file and checks its checksum too (as :func:`verify_dir` does): a damaged file is
    listed in ``problems`` and the recoverable steps are those recovery can really reach
    (a damaged record file ends its chain, a damaged full checkpoint serves nothing).

    Example:
        >>> info = lowdiff.inspect_dir("runs/ckpt")  # doctest: +SKIP
        >>> info.recoverable  # doctest: +SKIP
        (0, 240)
        >>> lowdiff.inspect_dir("runs/ckpt", verify=True).recoverable  # doctest: +SKIP
        (0, 240)
    """
    if is_job_dir(Path(directory)):
        raise NotACheckpointDirectoryError(
            f"{directory} is a distributed job's directory (one shard per rank): summarise it with "
            "lowdiff.inspect_job(), or one shard with inspect_dir() on its rank directory"
        )
    sc = scan(directory)
    problems = list(sc.problems)
    bad: set[Path] = set()
    if verify:
        for f in sc.fulls + sc.records:
            try:
                sfile.verify(f.path)
            except CorruptCheckpointError as e:
                problems.append((e.path, e.reason))
                bad.add(f.path)
    try:
        foreign = [(x.file.path, x.describe()) for x in make_plan(sc, None, bad).foreign]
    except RecoveryError:
        foreign = []  # nothing recoverable: ``recoverable`` says so
    return DirectoryInfo(
        sc.root,
        sc.manifest,
        sc.fulls,
        sc.records,
        recoverable_range(sc, bad),
        problems,
        recoverable_intervals(sc, bad),
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
    generations: list[Generation] = field(default_factory=list)
    """The job's generations, oldest first: one per world size it ran at (see
    :func:`lowdiff.recovery.job.generations`); ``shards`` lists theirs in this order."""

    def shard_name(self, shard: DirectoryInfo) -> str:
        """A shard's directory relative to the job's (``rank-00001``, ``gen-1/rank-00000``)."""
        try:
            rel = shard.root.relative_to(self.root)
        except ValueError:
            return shard.root.name
        return rel.as_posix() if rel.parts else shard.root.name

    def describe(self) -> str:
        """``distributed job, 2 ranks``, or each generation's world size and first step
        (``FSDP2 job``: shards of every parameter, written under ``fully_shard``)."""
        kind = "FSDP2 job" if self.manifest.get("sharding") == FSDP2 else "distributed job"
        if len(self.generations) <= 1:
            return f"{kind}, {_ranks(self.world_size)}"
        gens = ", ".join(
            f"{_ranks(g.world_size)} from step {g.start_step}" for g in self.generations
        )
        return f"{kind}, {len(self.generations)} generations: {gens}"

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def recoverable(self) -> tuple[int, int] | None:
        iv = self.recoverable_intervals
        return (iv[0][0], iv[-1][1]) if iv else None


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def inspect_job(directory: str | Path, *, verify: bool = False) -> JobInfo:
    """Summarise a distributed job's directory: every shard, and the steps all of them serve.

    A job resumed at other world sizes has several generations (see
    :func:`lowdiff.recovery.job.generations`): the shards of every generation are listed,
    oldest first, the steps are those some generation serves, and the manifest is the
    newest generation's. ``verify=True``: as for :func:`inspect_dir`, every shard's files
    are read and checked, and a step counts only if every shard reaches it through intact
    files.
    """
    root = Path(directory)
    gens = generations(root)
    shards: list[DirectoryInfo] = []
    spans: list[tuple[int, int]] = []
    for g in gens:
        infos = [inspect_dir(d, verify=verify) for d in g.shard_dirs()]
        shards.extend(infos)
        spans.extend(
            generation_intervals(g, {p for i in infos for p, _ in i.problems} if verify else None)
        )
    manifest = layout.read_manifest(gens[-1].root) if gens else layout.read_manifest(root)
    return JobInfo(root, manifest, shards, merge_intervals(spans), gens)


def is_job(path: str | Path) -> bool:
    """True when ``path`` is the root of a distributed job's checkpoint directory."""
    return is_job_dir(Path(path))


def verify_dir(directory: str | Path) -> tuple[int, list[tuple[Path, str]]]:
    """Check every checksum in the directory (every shard, for a distributed job).

    Returns:
        (number of files checked, [(path, reason) for every bad file]).
    """
    root = Path(directory)
    kind = directory_kind(root)
    if kind is not None:  # a registered method's directory (a baseline's): its own files
        return kind.verify(root)
    if is_job(root):
        n_checked, bad_shards = 1, []
        for g in generations(root):
            if g.single:  # a single process's directory that a job resumed
                n, b = _verify_plain(g.root)
                n_checked += n - 1  # its manifest is the job root's, counted above
                bad_shards.extend(b)
                continue
            n_checked += g.index > 0  # the generation's own job manifest
            for d in g.shard_dirs():
                if not (d / layout.MANIFEST).exists():
                    bad_shards.append((d, "shard directory missing or without a manifest"))
                    continue
                n, b = _verify_plain(d)
                n_checked += n
                bad_shards.extend(b)
        return n_checked, bad_shards
    return _verify_plain(root)


def _verify_plain(root: Path) -> tuple[int, list[tuple[Path, str]]]:
    """:func:`verify_dir` of one single-process or shard directory."""
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


def rebuild(
    path: str | Path, step: int | None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, RecoveryStats]:
    """Rebuild a stand-in model and optimizer from the checkpoint alone and restore ``step``
    (see :func:`lowdiff.exporting.rebuild`)."""
    return _rebuild(path, step)


def export(
    path: str | Path,
    step: int | None = None,
    out: str | Path | None = None,
    *,
    format: str = "safetensors",  # noqa: A002 -- the CLI's name
) -> int:
    """Write the state at ``step`` (None: newest) to ``out``; see :func:`lowdiff.exporting.export`.

    Returns:
        The exported step.
    """
    return _export(path, step, out, format=format)
