"""Whether a directory is lowdiff's to use: empty, or a checkpoint directory.

A trainer refuses to checkpoint into a directory that holds anything else
(:func:`check_directory`), and takes a directory that only ever got as far as its lock
files, its manifest or its temp files for an empty one (:func:`is_empty_dir`): nothing in
it was ever durable. Readers (:func:`lowdiff.recovery.scan.scan`) run the same check.
"""

from __future__ import annotations

import re
from pathlib import Path

from lowdiff.errors import LowDiffError, NotACheckpointDirectoryError
from lowdiff.format import layout
from lowdiff.format.atomic import TMP_PREFIX


def is_empty_dir(root: Path) -> bool:
    if not root.exists():
        return True
    # lock files, and a replica descriptor (LowDiff+ checks and cleans it up on resume)
    ignorable = {
        layout.LOCK_FILE,
        layout.WRITER_LOCK_FILE,
        layout.REPLICA_LOG,
        layout.PLAN_FILE,
        ".lowdiff.replica.json",
    }
    entries = list(root.iterdir())
    if all(
        _unused_subdir(p) for p in entries if p.name in (layout.FULL_DIR, layout.RECORDS_DIR)
    ) and _own_manifest(root):
        # a manifest and no checkpoint file: the trainer that created the directory died
        # before its first full checkpoint was written, so nothing was ever durable (a
        # manifest lowdiff cannot read is not its own: published atomically, lowdiff's is
        # never torn; it stays, and is refused as the file it is)
        ignorable.add(layout.MANIFEST)
    return all(
        p.name in ignorable or p.name.startswith(TMP_PREFIX) or _unused_subdir(p) for p in entries
    )


def _own_manifest(root: Path) -> bool:
    """Whether ``root`` has no manifest, or one lowdiff wrote (intact)."""
    if not (root / layout.MANIFEST).exists():
        return True
    try:
        layout.read_manifest(root)
    except (LowDiffError, OSError, ValueError):
        return False
    return True


def _unused_subdir(p: Path) -> bool:
    """``full/`` or ``records/`` holding nothing but temp files: what a trainer killed
    while it created the directory leaves behind before its first manifest."""
    return (
        p.name in (layout.FULL_DIR, layout.RECORDS_DIR)
        and p.is_dir()
        and all(q.name.startswith(TMP_PREFIX) for q in p.iterdir())
    )


def check_directory(root: Path, advice: str = " Use an empty or new directory.") -> None:
    """Raise :class:`NotACheckpointDirectoryError` unless ``root`` is empty or lowdiff's
    (``advice`` ends the message: a trainer's, by default; a reader's is '')."""
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
        f"(found: {shown}).{hint}{advice}"
    )
