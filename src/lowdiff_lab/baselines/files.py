"""The baselines' checkpoint files and the commit files that publish them.

A checkpoint ``X`` (a file, or a directory of files for ``dcp-async``) counts only once
its commit file ``X.commit`` exists: the commit holds the xxh3-128 digest of every byte,
and is written last, atomically. A torn, truncated or altered checkpoint, or one whose
commit is missing, is therefore named and passed over at recovery, never loaded.

- one file (``torch-save``, ``checkfreq``, ``gemini``, ``naive-dc``): :func:`save_state`
  writes it and its commit, :func:`read_committed` / :func:`load_state` verify and read it;
- a directory (a DCP checkpoint): :func:`publish_commit` digests the finished directory
  (in the saver, after DCP wrote it), :func:`verify_commit` checks it before a load.

Both the strategies and ``lowdiff verify`` (:mod:`lowdiff_lab.baselines.base`) read them here.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import layout
from lowdiff.format.atomic import atomic_open, fsync_dir, write_bytes_atomic
from lowdiff.recovery.stats import RecoveryStats

COMMIT_SUFFIX = ".commit"
"""A checkpoint file ``X`` is published only once ``X.commit`` (its digest) exists."""
DIR_COMMIT_FORMAT = "lowdiff-dcp-commit"
"""``format`` of the commit file of a checkpoint directory."""
_HASH_CHUNK = 1 << 20


def commit_path(path: Path) -> Path:
    """The commit file that publishes the checkpoint ``path``."""
    return path.with_name(path.name + COMMIT_SUFFIX)


def published(directory: Path, prefix: str, suffix: str) -> list[tuple[int, Path]]:
    """``(step, path)`` of the files ``{prefix}{step:012d}{suffix}`` in ``directory``, oldest first."""
    out = []
    if directory.is_dir():
        for p in directory.iterdir():
            name = p.name
            if name.startswith(prefix) and name.endswith(suffix):
                digits = name[len(prefix) : len(name) - len(suffix)]
                if len(digits) == 12 and digits.isdigit():
                    out.append((int(digits), p))
    return sorted(out)


def quarantine(root: Path, path: Path) -> None:
    """Move a damaged file (and its commit file) to ``DIR/quarantine/``; never delete it."""
    q = root / layout.QUARANTINE_DIR
    q.mkdir(exist_ok=True)
    for p in (path, commit_path(path)):
        if p.exists():
            shutil.move(str(p), q / f"{p.name}.{int(time.time())}")


# --------------------------------------------------------------------------- one file


class _HashingWriter:
    """A write-only file object that hashes what passes through it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.h, self.n = f, xxhash.xxh3_128(), 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        self.h.update(mv)
        self.n += mv.nbytes
        return self.f.write(mv)

    def flush(self) -> None:
        self.f.flush()


def save_state(path: Path, state: Any, *, step: int) -> int:
    """``torch.save`` ``state`` to ``path`` atomically, then publish its commit file.

    Returns:
        Bytes written.
    """
    with atomic_open(path) as f:
        hw = _HashingWriter(f)
        torch.save(state, hw)  # type: ignore[arg-type]  # any object with write() and flush()
    commit = {"file": path.name, "step": step, "bytes": hw.n, "xxh3_128": hw.h.hexdigest()}
    write_bytes_atomic(commit_path(path), json.dumps(commit, sort_keys=True).encode())
    return hw.n


def read_committed(path: Path) -> tuple[bytes, dict[str, Any]]:
    """Read a published checkpoint file and verify it against its commit file.

    Raises:
        CorruptCheckpointError: naming the file, if it or its commit is missing, torn or
            altered.
    """
    cpath = commit_path(path)
    try:
        commit = json.loads(cpath.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpointError(path, "no commit file: the write never finished") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(cpath, f"unreadable commit file ({e})") from None
    if not isinstance(commit, dict) or commit.get("file") != path.name:
        raise CorruptCheckpointError(cpath, "not the commit file of this checkpoint")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CorruptCheckpointError(path, f"cannot read: {e.strerror}") from None
    if len(raw) != commit.get("bytes"):
        raise CorruptCheckpointError(
            path, f"truncated or extended: {len(raw)} bytes, {commit.get('bytes')} committed"
        )
    if xxhash.xxh3_128_hexdigest(raw) != commit.get("xxh3_128"):
        raise CorruptCheckpointError(path, "checksum mismatch (the file was altered)")
    return raw, commit


def load_state(path: Path, stats: RecoveryStats | None = None) -> Any:
    """Read, verify and unpickle (``weights_only``) a file written by :func:`save_state`."""
    t0 = time.perf_counter()
    raw, _ = read_committed(path)
    t1 = time.perf_counter()
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # a verified file that does not load is foreign
        raise CorruptCheckpointError(path, f"not a loadable checkpoint ({e})") from None
    if stats is not None:
        stats.read_s += t1 - t0
        stats.decode_s += time.perf_counter() - t1
        stats.bytes_read += len(raw)
        stats.files_read += 1
    return obj


# --------------------------------------------------------------------------- a directory


def file_digest(path: Path) -> tuple[int, str]:
    """``(bytes, xxh3-128 hex digest)`` of the file ``path``, read in chunks."""
    # readinto one reused buffer: no fresh bytes object per chunk
    h, n = xxhash.xxh3_128(), 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])
            n += k
    return n, h.hexdigest()


def publish_commit(ckpt: Path, step: int) -> dict[str, Any]:
    """Digest every file of the finished checkpoint directory ``ckpt``; publish ``ckpt.commit``."""
    fsync_dir(ckpt)  # DCP renames .metadata into place without syncing the directory
    files: list[dict[str, Any]] = []
    for p in sorted(ckpt.iterdir()):
        n, digest = file_digest(p)
        files.append({"name": p.name, "bytes": n, "xxh3_128": digest})
    commit = {
        "format": DIR_COMMIT_FORMAT,
        "dir": ckpt.name,
        "step": step,
        "bytes": sum(f["bytes"] for f in files),
        "files": files,
    }
    write_bytes_atomic(commit_path(ckpt), json.dumps(commit, sort_keys=True).encode())
    return commit


def verify_commit(ckpt: Path, step: int) -> dict[str, Any]:
    """Check a checkpoint directory against its commit file; returns the commit.

    Raises:
        CorruptCheckpointError: naming the directory or file that is missing, uncommitted,
            truncated, altered or foreign.
    """
    cpath = commit_path(ckpt)
    try:
        commit = json.loads(cpath.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpointError(ckpt, "no commit file: the save never finished") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(cpath, f"unreadable commit file ({e})") from None
    if (
        not isinstance(commit, dict)
        or commit.get("format") != DIR_COMMIT_FORMAT
        or commit.get("dir") != ckpt.name
        or commit.get("step") != step
        or not isinstance(commit.get("files"), list)
    ):
        raise CorruptCheckpointError(cpath, "not the commit file of this checkpoint")
    if not ckpt.is_dir():
        raise CorruptCheckpointError(ckpt, "the committed checkpoint directory is missing")
    want = {f["name"]: f for f in commit["files"]}
    have = {p.name for p in ckpt.iterdir()}
    if have != set(want):
        extra, missing = sorted(have - set(want)), sorted(set(want) - have)
        raise CorruptCheckpointError(
            ckpt, f"files differ from the commit (missing: {missing}, not committed: {extra})"
        )
    for name, f in want.items():
        n, digest = file_digest(ckpt / name)
        if n != f["bytes"]:
            raise CorruptCheckpointError(
                ckpt / name, f"truncated or extended: {n} bytes, {f['bytes']} committed"
            )
        if digest != f["xxh3_128"]:
            raise CorruptCheckpointError(ckpt / name, "checksum mismatch (the file was altered)")
    return commit
