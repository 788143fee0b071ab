"""The commit object of a remote tier: what publishes a data object, and its checks.

``REMOTE/<name>.commit`` publishes the data object ``REMOTE/data/<name>.<token>`` (see
:mod:`lowdiff.remote.store` and ``docs/format.md``, "Remote tier"): canonical JSON
``{"checksum": "xxh3:<hex>", "lowdiff_commit": {"format": "lowdiff", "format_version": 1,
"name", "object", "size", "xxh3"}}``. A reader takes a commit only when every byte of it
checks (:meth:`Commit.decode`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash

from lowdiff.errors import CorruptCheckpointError

COMMIT_SUFFIX = ".commit"
"""What ends a commit object's name (``<name>.commit``)."""
DATA_DIR = "data"
"""The folder of the data objects."""
TMP_MARK = ".tmp-"
"""How a commit object still being written on a file system starts (a temp file)."""
COMMIT_FORMAT_VERSION = 1


def _canonical(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, allow_nan=False) + "\n").encode("utf-8")


def _body_hash(body: Any) -> str:
    compact = json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return "xxh3:" + xxhash.xxh3_64_hexdigest(compact)


@dataclass(frozen=True)
class Commit:
    """A published object: the local ``name`` it stands for, its data key (relative to
    the remote root), its size and the xxh3-64 of its bytes."""

    name: str
    object: str
    size: int
    xxh3: str

    def encode(self) -> bytes:
        body = {
            "format": "lowdiff",
            "format_version": COMMIT_FORMAT_VERSION,
            "name": self.name,
            "object": self.object,
            "size": self.size,
            "xxh3": self.xxh3,
        }
        return _canonical({"checksum": _body_hash(body), "lowdiff_commit": body})

    @staticmethod
    def decode(where: str, raw: bytes) -> Commit:
        """Parse and check a commit object read from ``where``; raises
        :class:`CorruptCheckpointError` naming it when any byte is off."""
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CorruptCheckpointError(
                where, "commit object is not valid JSON (torn or corrupt)"
            ) from None
        if not isinstance(obj, dict) or set(obj) != {"checksum", "lowdiff_commit"}:
            raise CorruptCheckpointError(where, "not a lowdiff commit object")
        body = obj["lowdiff_commit"]
        if obj["checksum"] != _body_hash(body) or _canonical(obj) != raw:
            raise CorruptCheckpointError(where, "commit object checksum mismatch")
        if body.get("format") != "lowdiff" or body.get("format_version") != COMMIT_FORMAT_VERSION:
            raise CorruptCheckpointError(where, "foreign or newer commit object")
        try:
            c = Commit(str(body["name"]), str(body["object"]), int(body["size"]), str(body["xxh3"]))
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(where, "commit object misses a field") from None
        if not c.object.startswith(f"{DATA_DIR}/{c.name}.") or c.size < 0:
            raise CorruptCheckpointError(where, "commit object names a foreign data object")
        return c
