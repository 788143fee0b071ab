"""Moving files out of a shard's chain at resume: damaged files and files past the
recovered step go to ``DIR/quarantine/<time>-<run>/`` (never deleted).

After a resume to step ``s`` the new session writes records from ``s`` on, so every
record of a step ``>= s`` still on disk belongs to the old trajectory and must leave the
chain. A record file that straddles ``s`` (``first < s <= last``) also holds records
``first .. s-1``, which the recovered state was built from and which, in a distributed
job, the other shards' chains need too (``s`` is the minimum over the shards, so the
leading shard's files often straddle it). Such a file is split: its rows before ``s``
are published as a new file ``rec-<first>-<s-1>`` first, then the original is moved, so
that a crash at any moment leaves those rows in the chain.

Each rank quarantines files of its own shard only (``root``); the damaged files of the
other shards that its recovery passed over are theirs to move.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import warnings
from pathlib import Path

import torch

from lowdiff.errors import CorruptCheckpointError, InvalidArgumentError, RecoveryWarning
from lowdiff.format import layout, sfile
from lowdiff.format.atomic import TMP_PREFIX, fsync_dir
from lowdiff.recovery.stats import RecoveryStats


def quarantine_beyond(root: Path, stats: RecoveryStats, run_id: str) -> list[Path]:
    """Move files that are damaged or lie past the recovered step out of ``root``'s chain.

    ``root`` is a single-process directory or one shard of a distributed job, and
    ``stats.step`` the step recovered (under DDP the step all ranks agreed on). Moved:
    the damaged files of ``root`` in ``stats.skipped``, full checkpoints after the step,
    and record files that start at or after it. A record file that straddles the step
    is split (see the module docstring). The moves are made durable (the quarantine
    directory and the source directories are fsynced) before this returns.

    Returns:
        The new paths of the moved files, in ``DIR/quarantine/<time>-<run>/``.

    Example:
        >>> stats = recover(root, model, optimizer)  # doctest: +SKIP
        >>> quarantine_beyond(root, stats, run_id)  # doctest: +SKIP
    """
    s = stats.step
    move, straddling = _beyond(root, stats)
    if not move and not straddling:
        return []
    dest = (
        root / layout.QUARANTINE_DIR / (_dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + run_id[:8])
    )
    dest.mkdir(parents=True, exist_ok=True)
    moved, split = _split_straddling(root, straddling, s, dest)
    moved += [_move(p, dest) for p in move if p.exists()]
    _fsync_moves(root, dest, [*move, *(p for p, _, _ in straddling)])
    what = f"moved {len(moved)} file(s) that are damaged or past the recovered step {s} to {dest}"
    if split:
        what += f"; kept the records before step {s} of " + ", ".join(split)
    warnings.warn(f"lowdiff: {what}", RecoveryWarning, stacklevel=4)
    return moved


def _beyond(root: Path, stats: RecoveryStats) -> tuple[list[Path], list[tuple[Path, int, int]]]:
    """The files of ``root`` to move whole (damaged, or past ``stats.step``), and the
    record files that straddle the step, as ``(path, first, last)``."""
    s = stats.step
    damaged = {Path(p).resolve() for p, _ in stats.skipped if _inside(Path(p), root)}
    move: list[Path] = [p for p in _files(root, layout.FULL_DIR) if p.resolve() in damaged]
    straddling: list[tuple[Path, int, int]] = []
    for p in _files(root, layout.FULL_DIR):
        step = layout.parse_full_name(p.name)
        if step is not None and step > s:
            move.append(p)
    for p in _files(root, layout.RECORDS_DIR):
        r = layout.parse_records_name(p.name)
        if p.resolve() in damaged or (r is not None and r[0] >= s):
            move.append(p)
        elif r is not None and r[0] < s <= r[1]:
            straddling.append((p, r[0], r[1]))
    return list(dict.fromkeys(move)), straddling


def _split_straddling(
    root: Path, straddling: list[tuple[Path, int, int]], s: int, dest: Path
) -> tuple[list[Path], list[str]]:
    """Publish the records before step ``s`` of each straddling file as a file of their
    own, then move the file to ``dest``; returns the moved paths and the splits made
    (``"old -> new"``)."""
    moved: list[Path] = []
    split: list[str] = []
    published: set[Path] = set()
    # longest first: the file recovery's chain took its records from (scan.chain_from)
    for p, first, _ in sorted(straddling, key=lambda x: (x[1], -x[2])):
        kept = layout.records_path(root, first, s - 1)
        if kept not in published:
            try:
                head = _records_before(p, s)
            except CorruptCheckpointError:
                pass  # damaged: none of it can be kept, it is quarantined whole below
            else:
                if kept.exists():
                    # a file already under the name the split publishes: set aside, not overwritten
                    moved.append(_move(kept, dest))
                sfile.write(kept, *head)
                published.add(kept)
        if kept in published:
            split.append(f"{p.name} -> {kept.name}")
        moved.append(_move(p, dest))
    return moved, split


def split_records(path: Path, step: int) -> Path:
    """Publish the records of ``path`` before ``step`` as a file of their own.

    ``path`` holds records ``first .. last`` with ``first < step <= last``; the new file
    ``rec-<first>-<step-1>`` (in the same directory, published atomically) holds rows
    ``first .. step-1`` with their ``records_meta`` entries, ``last_step`` and
    ``n_records`` set to match, and every other metadata field (``layout_id``,
    ``run_id``, ...) as in ``path``. ``path`` itself is left in place.

    Returns:
        The new file's path.

    Raises:
        CorruptCheckpointError: ``path`` is damaged, or its contents disagree with its name.
        ValueError: ``step`` does not split ``path``.

    Example:
        >>> split_records(d / "records" / "rec-000000000004-000000000006.safetensors", 5)  # doctest: +SKIP
        PosixPath('.../records/rec-000000000004-000000000004.safetensors')
    """
    first, _ = _records_range(path)
    out = layout.records_path(path.parent.parent, first, step - 1)
    sfile.write(out, *_records_before(path, step))
    return out


def _records_range(path: Path) -> tuple[int, int]:
    rng = layout.parse_records_name(path.name)
    if rng is None:
        raise CorruptCheckpointError(path, "not a record file name")
    return rng


def _records_before(
    path: Path, step: int
) -> tuple[list[sfile.TensorEntry], torch.Tensor, dict[str, str]]:
    """Read and verify ``path``; the entries, data and metadata of its records before ``step``."""
    first, last = _records_range(path)
    if not first < step <= last:
        raise InvalidArgumentError(f"step {step} does not split {path.name} (records {first}..{last})")
    lf = sfile.read(path)
    md = dict(lf.metadata)
    n = last - first + 1
    if (md.get("kind"), md.get("first_step"), md.get("last_step"), md.get("n_records")) != (
        "records",
        str(first),
        str(last),
        str(n),
    ):
        raise CorruptCheckpointError(path, "metadata does not match the file name")
    rows = lf.tensors.get("records")
    try:
        metas = json.loads(md["records_meta"])
    except (KeyError, ValueError):
        raise CorruptCheckpointError(path, "records_meta is missing or not JSON") from None
    if (
        rows is None
        or len(lf.tensors) != 1
        or rows.dim() != 2
        or rows.shape[0] != n
        or not isinstance(metas, list)
        or len(metas) != n
    ):
        raise CorruptCheckpointError(path, "record table has the wrong shape")
    k = step - first
    md.update(
        first_step=str(first),
        last_step=str(step - 1),
        n_records=str(k),
        # each entry as the writer wrote it: compact, key-sorted JSON (lowdiff.format.codec)
        records_meta=json.dumps(metas[:k], sort_keys=True, separators=(",", ":"), allow_nan=False),
    )
    row_bytes = int(rows.shape[1])
    entry = sfile.TensorEntry("records", torch.uint8, (k, row_bytes), 0, k * row_bytes)
    return [entry], rows[:k].reshape(-1), md


def _files(root: Path, sub: str) -> list[Path]:
    """The files of ``root/sub`` (temp files aside), sorted by name."""
    d = root / sub
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith(TMP_PREFIX))


def _inside(path: Path, root: Path) -> bool:
    return root.resolve() in path.resolve().parents


def _move(path: Path, dest: Path) -> Path:
    target = dest / f"{path.parent.name}--{path.name}"
    os.replace(path, target)
    return target


def _fsync_moves(root: Path, dest: Path, sources: list[Path]) -> None:
    """Make the renames durable: first the new entries (the quarantine directory, and the
    directories it may have created), then the removals from the source directories."""
    for d in dict.fromkeys((dest, dest.parent, root, *(p.parent for p in sources))):
        fsync_dir(d)
