"""The layout of a lowdiff checkpoint directory.

::

    DIR/
      lowdiff.json                         manifest: format version, model signature,
                                           compressor, record layout (checksummed JSON)
      full/full-000000000030.safetensors   full checkpoint: the state after 30 updates
      records/rec-000000000030-000000000032.safetensors
                                           records 30, 31, 32 (batched, one write)
      quarantine/...                       files set aside at recovery (corrupt, or beyond
                                           the recovered step); never read again
      .lowdiff.lock, .lowdiff.writer.lock  held by the trainer and its checkpointing process
      .lowdiff.plan.json                   with full_every/batch_size "auto": the last (f, b)
                                           planned, where a restarted trainer starts

File names are only an index: every file also carries its kind and steps in its own
checksummed metadata, and recovery checks that the two agree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import xxhash

from lowdiff.errors import CorruptCheckpointError, NewerFormatError
from lowdiff.format.atomic import write_bytes_atomic
from lowdiff.format.sfile import FORMAT_NAME, FORMAT_VERSION, newer_version_reason, open_regular

MANIFEST = "lowdiff.json"
FULL_DIR = "full"
RECORDS_DIR = "records"
QUARANTINE_DIR = "quarantine"
LOCK_FILE = ".lowdiff.lock"
WRITER_LOCK_FILE = ".lowdiff.writer.lock"
REPLICA_LOG = ".lowdiff.replica.log"
PLAN_FILE = ".lowdiff.plan.json"
"""The last (f, b) the ``"auto"`` planner chose (a hint, never needed for recovery: see
:mod:`lowdiff.engine.trainer.autotune`)."""
"""Where a LowDiff+ replica whose trainer died writes what it prints (see
:func:`lowdiff.proc.spawn.release_trainer_stdio`)."""

_FULL_RE = re.compile(r"^full-(\d{12})\.safetensors$")
_REC_RE = re.compile(r"^rec-(\d{12})-(\d{12})\.safetensors$")


def full_path(root: Path, step: int) -> Path:
    return root / FULL_DIR / f"full-{step:012d}.safetensors"


def records_path(root: Path, first: int, last: int) -> Path:
    return root / RECORDS_DIR / f"rec-{first:012d}-{last:012d}.safetensors"


def parse_full_name(name: str) -> int | None:
    m = _FULL_RE.match(name)
    return int(m.group(1)) if m else None


def parse_records_name(name: str) -> tuple[int, int] | None:
    m = _REC_RE.match(name)
    if not m:
        return None
    first, last = int(m.group(1)), int(m.group(2))
    return (first, last) if first <= last else None


def _canonical(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, allow_nan=False) + "\n").encode("utf-8")


def _body_hash(body: Any) -> str:
    return "xxh3:" + xxhash.xxh3_64_hexdigest(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")
    )


_verified: dict[str, bytes] = {}
"""Per manifest path, the bytes this process last wrote or verified there: the same
bytes read again need no second check (a session reads its manifest several times)."""


def write_manifest(root: Path, body: dict[str, Any]) -> None:
    """Publish the manifest atomically, with its checksum."""
    raw = _canonical({"checksum": _body_hash(body), "lowdiff_manifest": body})
    write_bytes_atomic(root / MANIFEST, raw)
    _verified[str(root / MANIFEST)] = raw


def read_manifest(root: Path) -> dict[str, Any]:
    """Read and verify the manifest. Any changed byte raises :class:`CorruptCheckpointError`."""
    path = root / MANIFEST
    try:
        with open_regular(path) as f:
            raw = f.read()
    except OSError as e:
        raise CorruptCheckpointError(path, f"cannot read: {e.strerror}") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptCheckpointError(path, "not valid JSON (torn or corrupt)") from None
    if _verified.get(str(path)) == raw:
        body = obj["lowdiff_manifest"]
        _check_version(path, body)  # what this process wrote may be any version
        return body  # type: ignore[no-any-return]
    if not isinstance(obj, dict) or set(obj) != {"checksum", "lowdiff_manifest"}:
        raise CorruptCheckpointError(path, "not a lowdiff manifest")
    body = obj["lowdiff_manifest"]
    if obj["checksum"] != _body_hash(body):
        raise CorruptCheckpointError(path, "checksum mismatch")
    if _canonical(obj) != raw:
        # equal values but different bytes: something rewrote the file
        raise CorruptCheckpointError(
            path, "bytes differ from the canonical form (modified after writing)"
        )
    if not isinstance(body, dict):
        raise CorruptCheckpointError(path, "manifest body is not an object")
    _check_version(path, body)
    if len(_verified) > 64:
        _verified.clear()
    _verified[str(path)] = raw
    return body


def _check_version(path: Path, body: dict[str, Any]) -> None:
    """Refuse a lowdiff manifest of a newer format version (docs/format.md)."""
    if body.get("format") == FORMAT_NAME:
        version = body.get("format_version", 1)  # a job's manifest has none: version 1
        if type(version) is not int or version < 1:
            raise CorruptCheckpointError(path, f"bad format_version {version!r}")
        if version > FORMAT_VERSION:
            raise NewerFormatError(path, newer_version_reason(version))
