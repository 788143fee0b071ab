"""Finding what a checkpoint directory can recover, and how.

``scan`` reads only file names and headers (cheap). Checksums of the data are verified
when a file is actually used (during replay) and by ``lowdiff verify``.

A *plan* for a target step ``T`` is a full checkpoint ``F <= T`` plus the record files
that hold records ``F .. T-1`` without a gap. Record files may straddle a full
checkpoint (a batch ``[29, 31]`` serves ``F = 30`` from its second record on).
"""

from __future__ import annotations

import re
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from lowdiff.errors import CorruptCheckpointError, NotACheckpointDirectoryError, RecoveryError
from lowdiff.format import layout, sfile
from lowdiff.format.atomic import TMP_PREFIX


@dataclass
class FileInfo:
    """One full checkpoint or record file."""

    path: Path
    kind: str
    first_step: int
    last_step: int
    nbytes: int
    n_records: int


@dataclass
class Scan:
    root: Path
    manifest: dict
    fulls: list[FileInfo] = field(default_factory=list)
    records: list[FileInfo] = field(default_factory=list)
    problems: list[tuple[Path, str]] = field(default_factory=list)


@dataclass
class Plan:
    full: FileInfo
    target: int
    record_files: list[FileInfo]


def is_empty_dir(root: Path) -> bool:
    if not root.exists():
        return True
    # lock files, and a replica descriptor (LowDiff+ checks and cleans it up on resume)
    ignorable = {layout.LOCK_FILE, layout.WRITER_LOCK_FILE, ".lowdiff.replica.json"}
    entries = list(root.iterdir())
    if all(_unused_subdir(p) for p in entries if p.name in (layout.FULL_DIR, layout.RECORDS_DIR)):
        # a manifest and no checkpoint file: the trainer that created the directory died
        # before its first full checkpoint was written, so nothing was ever durable
        ignorable.add(layout.MANIFEST)
    return all(
        p.name in ignorable or p.name.startswith(TMP_PREFIX) or _unused_subdir(p) for p in entries
    )


def _unused_subdir(p: Path) -> bool:
    """``full/`` or ``records/`` holding nothing but temp files: what a trainer killed
    while it created the directory leaves behind before its first manifest."""
    return (
        p.name in (layout.FULL_DIR, layout.RECORDS_DIR)
        and p.is_dir()
        and all(q.name.startswith(TMP_PREFIX) for q in p.iterdir())
    )


def check_directory(root: Path) -> None:
    """Raise :class:`NotACheckpointDirectoryError` unless ``root`` is empty or lowdiff's."""
    if root.exists() and not root.is_dir():
        raise NotACheckpointDirectoryError(f"{root} is a file, not a checkpoint directory")
    if is_empty_dir(root) or (root / layout.MANIFEST).exists():
        return
    if all(
        (p.is_dir() and re.fullmatch(r"rank-\d{5}", p.name)) or p.name.startswith(TMP_PREFIX)
        for p in root.iterdir()
    ):
        return  # a distributed job's root while its ranks are starting
    names = sorted(p.name for p in root.iterdir())
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    hint = ""
    if (root / layout.FULL_DIR).exists() or (root / layout.RECORDS_DIR).exists():
        hint = (
            f" It has lowdiff's sub-directories but no {layout.MANIFEST}: the manifest was deleted."
        )
    raise NotACheckpointDirectoryError(
        f"{root} is not empty and holds no {layout.MANIFEST}: it is not a lowdiff checkpoint directory "
        f"(found: {shown}).{hint} Use an empty or new directory."
    )


def scan(root: str | Path) -> Scan:
    """List and header-check every checkpoint file under ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise NotACheckpointDirectoryError(f"{root} does not exist or is not a directory")
    check_directory(root)
    if not (root / layout.MANIFEST).exists():
        raise NotACheckpointDirectoryError(
            f"{root} holds no lowdiff checkpoint (no {layout.MANIFEST})"
        )
    out = Scan(root, layout.read_manifest(root))
    for sub, kind in ((layout.FULL_DIR, "full"), (layout.RECORDS_DIR, "records")):
        d = root / sub
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.name.startswith(TMP_PREFIX):
                continue
            try:
                out_info = _header_info(p, kind)
            except CorruptCheckpointError as e:
                out.problems.append((p, e.reason))
                continue
            (out.fulls if kind == "full" else out.records).append(out_info)
    out.fulls.sort(key=lambda f: f.first_step)
    out.records.sort(key=lambda f: (f.first_step, f.last_step))
    return out


def _header_info(p: Path, kind: str) -> FileInfo:
    if kind == "full":
        step = layout.parse_full_name(p.name)
        if step is None:
            raise CorruptCheckpointError(p, "unexpected file name in full/ (a foreign file?)")
        hdr = sfile.read_header(p)
        if hdr.kind != "full" or hdr.metadata.get("step") != str(step):
            raise CorruptCheckpointError(p, "metadata does not match the file name")
        return FileInfo(p, "full", step, step, hdr.file_size, 0)
    rng = layout.parse_records_name(p.name)
    if rng is None:
        raise CorruptCheckpointError(p, "unexpected file name in records/ (a foreign file?)")
    hdr = sfile.read_header(p)
    md = hdr.metadata
    if (
        hdr.kind != "records"
        or md.get("first_step") != str(rng[0])
        or md.get("last_step") != str(rng[1])
    ):
        raise CorruptCheckpointError(p, "metadata does not match the file name")
    n = rng[1] - rng[0] + 1
    if md.get("n_records") != str(n):
        raise CorruptCheckpointError(p, "record count does not match the steps it covers")
    return FileInfo(p, "records", rng[0], rng[1], hdr.file_size, n)


def chain_from(
    s: Scan, start: int, exclude: AbstractSet[Path] = frozenset()
) -> tuple[int, list[FileInfo]]:
    """Follow records from ``start`` without a gap; returns (reachable step, files used)."""
    step, used = start, []
    by_first = sorted(
        (f for f in s.records if f.path not in exclude), key=lambda f: (f.first_step, -f.last_step)
    )
    progressed = True
    while progressed:
        progressed = False
        for f in by_first:
            if f.first_step <= step <= f.last_step:
                used.append(f)
                step = f.last_step + 1
                progressed = True
                break
    return step, used


def recoverable_intervals(
    s: Scan, exclude: AbstractSet[Path] = frozenset()
) -> list[tuple[int, int]]:
    """Recoverable steps as sorted, disjoint inclusive intervals (by headers alone)."""
    spans = sorted(
        (f.first_step, chain_from(s, f.first_step, exclude)[0])
        for f in s.fulls
        if f.path not in exclude
    )
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def recoverable_range(s: Scan, exclude: AbstractSet[Path] = frozenset()) -> tuple[int, int] | None:
    """(oldest, newest) recoverable step by headers alone, or None. See also
    :func:`recoverable_intervals`: steps inside a gap between the two are not recoverable."""
    iv = recoverable_intervals(s, exclude)
    return (iv[0][0], iv[-1][1]) if iv else None


def describe_intervals(iv: list[tuple[int, int]]) -> str:
    return ", ".join(f"{lo}..{hi}" for lo, hi in iv) if iv else "none"


def make_plan(s: Scan, target: int | None, exclude: AbstractSet[Path] = frozenset()) -> Plan:
    """Choose the full checkpoint and records that reach ``target`` (None: the newest step)."""
    fulls = [f for f in s.fulls if f.path not in exclude]
    if not fulls:
        raise RecoveryError(f"{s.root}: no usable full checkpoint" + _problems_suffix(s))
    options = []
    for f in fulls:
        reach, files = chain_from(s, f.first_step, exclude)
        options.append((reach, f, files))
    if target is None:
        reach, f, files = max(options, key=lambda o: (o[0], o[1].first_step))
        return Plan(f, reach, files)
    candidates = [o for o in options if o[1].first_step <= target <= o[0]]
    if not candidates:
        iv = recoverable_intervals(s, exclude)
        have = f"recoverable steps are {describe_intervals(iv)}" if iv else "nothing is recoverable"
        raise RecoveryError(
            f"{s.root}: step {target} is not recoverable; {have}" + _problems_suffix(s)
        )
    _, f, files = max(candidates, key=lambda o: o[1].first_step)
    return Plan(f, target, [r for r in files if r.first_step < target])


def _problems_suffix(s: Scan) -> str:
    if not s.problems:
        return ""
    return " (damaged: " + "; ".join(f"{p.name}: {why}" for p, why in s.problems) + ")"
