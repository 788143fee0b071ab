"""A checkpoint directory's remote tier on any fsspec file system, with a commit protocol.

Layout under the remote URL ``REMOTE`` (see ``docs/format.md``, "Remote tier"):

- ``REMOTE/data/<name>.<token>``: the bytes of the local file ``<name>``
  (``lowdiff.json``, ``full/full-<step>.safetensors``, ``records/rec-<a>-<b>.safetensors``),
  uploaded under a key no other upload uses (``token``: 16 random hex digits).
- ``REMOTE/<name>.commit``: the commit object that publishes it: canonical JSON
  ``{"checksum": "xxh3:<hex>", "lowdiff_commit": {"format": "lowdiff", "format_version": 1,
  "name", "object", "size", "xxh3"}}``; ``object`` is the data key, ``size`` its length in
  bytes, ``xxh3`` the xxh3-64 of its bytes, ``checksum`` the xxh3-64 of the compact JSON of
  the body. It is written only after the data object is complete and its size checked.

A distributed job's remote tier is one such tier per folder of the job directory
(``REMOTE/rank-NNNNN/``, ``REMOTE/gen-G/``, ...; :meth:`RemoteStore.sub`), each with its
own ``data/``, written and cleaned by its own writer.

A reader uses only committed objects and checks size and checksum of every byte it
downloads; a data object without a commit (a crash between upload and commit) is never
read and is deleted by the next writer (:meth:`RemoteStore.clean`), with the multipart
uploads an S3 writer left behind.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from lowdiff.errors import CorruptCheckpointError, RemoteStorageError
from lowdiff.format import layout
from lowdiff.format.atomic import atomic_open
from lowdiff.remote.commit import COMMIT_SUFFIX, DATA_DIR, TMP_MARK, Commit

CHUNK_BYTES = 8 << 20
"""Bytes per write to the remote file (the unit of the bandwidth cap and of progress)."""
SINGLE_PUT_BYTES = 64 << 20
"""Files up to this size go up in one PUT when no bandwidth cap is set; larger ones (and
every file under a cap) are streamed in chunks, so memory stays bounded."""


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a remote tier (``scheme://...``) rather than a local path."""
    return "://" in str(path)


def preload(url: str) -> None:
    """Import the fsspec implementation of ``url``'s protocol now (s3fs, gcsfs, ...).

    Called by the trainer before lowdiff's process server is forked from it, so that
    every checkpointing process finds the client imported: a process importing s3fs
    itself takes seconds of CPU at its low priority, all of it before the first upload.
    An unknown protocol or a missing package is an error here, at construction.
    """
    try:
        import fsspec
    except ImportError:
        raise RemoteStorageError(
            "remote= needs fsspec (pip install 'lowdiff[remote]', and s3fs for s3://)"
        ) from None
    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        raise RemoteStorageError(
            f"remote={url!r}: no fsspec backend for {protocol!r}: {e}"
        ) from None


def _base(name: str) -> str:
    return name.rsplit("/", 1)[-1]


class _Transfer:
    """The bytes of one remote tier's uploads and downloads: streamed in chunks of
    :data:`CHUNK_BYTES` (or sent in one PUT), hashed on the way, paced to ``bandwidth``
    (bytes per second, or None), each chunk sent reported to ``progress``."""

    def __init__(
        self, fs: Any, bandwidth: float | None, progress: Callable[[int], None] | None
    ) -> None:
        self.fs, self.bandwidth, self.progress = fs, bandwidth, progress

    def put(self, local: Path, key: str, hook: Callable[[str], None] | None) -> tuple[int, str]:
        """Upload the file ``local`` to ``key``; returns its size and xxh3-64. Small files
        go in one PUT when no cap is set, others in chunks (so memory stays bounded)."""
        if self.bandwidth is None and local.stat().st_size <= SINGLE_PUT_BYTES:
            return self._put_whole(local, key, hook)
        return self._put_chunks(local, key, hook)

    def _put_whole(
        self, local: Path, key: str, hook: Callable[[str], None] | None
    ) -> tuple[int, str]:
        """One PUT of the whole file (read once, hashed from memory): what a plain
        ``put_file`` of a file this size does, so an upload costs no more than one."""
        data = local.read_bytes()
        digest = xxhash.xxh3_64_hexdigest(data)
        if hook is not None:
            hook("chunk")
        self.fs.pipe_file(key, data)
        if self.progress is not None:
            self.progress(len(data))
        return len(data), digest

    def _put_chunks(
        self, local: Path, key: str, hook: Callable[[str], None] | None
    ) -> tuple[int, str]:
        """Stream the file in chunks (a multipart upload on S3 past its block size),
        keeping to the bandwidth cap."""
        h = xxhash.xxh3_64()
        size = 0
        t0 = time.monotonic()
        with open(local, "rb") as src, self.fs.open(key, "wb") as dst:
            while chunk := src.read(CHUNK_BYTES):
                dst.write(chunk)
                h.update(chunk)
                size += len(chunk)
                if self.progress is not None:
                    self.progress(len(chunk))
                if hook is not None:
                    hook("chunk")
                self._throttle(size, t0)
        return size, h.hexdigest()

    def _throttle(self, sent: int, t0: float) -> None:
        """Sleep so that ``sent`` bytes since ``t0`` stay within the bandwidth cap."""
        if self.bandwidth:
            ahead = sent / self.bandwidth - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def get(self, key: str, dest: Path, commit: Commit, where: str) -> None:
        """Download ``key`` (``commit``'s data object, ``where`` in messages) to ``dest``,
        published atomically once its size and checksum match the commit's."""
        h = xxhash.xxh3_64()
        size = 0
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.fs.open(key, "rb") as src, atomic_open(dest) as f:
                while chunk := src.read(CHUNK_BYTES):
                    f.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
                    if size > commit.size:
                        break
                if size != commit.size:
                    raise CorruptCheckpointError(
                        where,
                        f"{size} bytes or more, the commit says {commit.size} (truncated or replaced)",
                    )
                if h.hexdigest() != commit.xxh3:
                    raise CorruptCheckpointError(where, "checksum mismatch with its commit")
        except FileNotFoundError:
            raise CorruptCheckpointError(where, "committed but missing") from None


class RemoteStore:
    """One remote tier: ``url`` (any fsspec URL) and ``options`` for fsspec.

    Args:
        url: where the checkpoint directory's remote copy lives (``s3://bucket/run``,
            ``gcs://...``, ``file:///mnt/shared/run``, ...).
        options: keyword arguments of the fsspec file system (credentials, endpoint,
            ``client_kwargs``, ...), passed through unchanged.
        bandwidth: upload cap in bytes per second, or None.
        progress: called with the bytes of each chunk sent (the uploader's heartbeat).

    Every call of the file system may raise what it raises (``OSError``, a client's own
    connection errors); callers that retry treat any ``Exception`` as a failed attempt.
    """

    def __init__(
        self,
        url: str,
        options: dict[str, Any] | None = None,
        *,
        bandwidth: float | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        try:
            import fsspec
        except ImportError:  # pragma: no cover - depends on the installation
            raise RemoteStorageError(
                "remote= needs fsspec (pip install 'lowdiff[remote]', and s3fs for s3://)"
            ) from None
        self.url = url.rstrip("/")
        # a fresh instance: one cached in a parent process does not survive a fork
        fs, root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **(options or {}))
        self.fs: Any = fs
        self.root = str(root).rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.local = "file" in protocol or "local" in protocol
        self.transfer = _Transfer(fs, bandwidth, progress)
        """Moves the bytes: the bandwidth cap and the progress reports live there."""

    def sub(self, rel: str) -> RemoteStore:
        """The remote tier in the folder ``rel`` under this one, on the same file system
        (a distributed job's shard ``rank-NNNNN`` or generation ``gen-G``: each folder of
        a job directory is a remote tier of its own, with its own ``data/``)."""
        if not rel:
            return self
        out = copy.copy(self)
        out.url, out.root = f"{self.url}/{rel}", f"{self.root}/{rel}"
        return out

    # ------------------------------------------------------------------ keys
    def key(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def where(self, rel: str) -> str:
        """``rel`` as a URL, for messages."""
        return f"{self.url}/{rel}"

    def _ls(self, rel: str) -> list[str]:
        """Names (relative to ``rel``) in the remote folder ``rel``; [] when it is absent."""
        path = self.key(rel) if rel else self.root
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)  # s3fs caches listings
        try:
            found = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]

    def folders(self, rel: str = "") -> list[str]:
        """Names of the folders in the remote folder ``rel`` (those of a job's shards and
        generations, and ``data``, ``full``, ``records``); [] when it is absent."""
        path = self.key(rel) if rel else self.root
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)
        try:
            found = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            for e in found
            if e.get("type") == "directory"
        )

    # ------------------------------------------------------------------ reading commits
    def read_commit(self, name: str) -> Commit:
        """The commit of ``name``; FileNotFoundError when it has none, and
        :class:`CorruptCheckpointError` when the commit object is damaged."""
        rel = name + COMMIT_SUFFIX
        raw = self.fs.cat_file(self.key(rel))
        c = Commit.decode(self.where(rel), raw)
        if c.name != name:
            raise CorruptCheckpointError(self.where(rel), f"commit object is for {c.name!r}")
        return c

    def commits(self, folder: str) -> tuple[dict[str, Commit], list[str]]:
        """The commits in ``folder`` (``"full"``, ``"records"`` or ``""`` for the root),
        by name; and the damaged commit objects there (what is wrong, named)."""
        out: dict[str, Commit] = {}
        bad: list[str] = []
        for n in self._ls(folder):
            if not n.endswith(COMMIT_SUFFIX) or n.startswith(TMP_MARK):
                continue
            name = f"{folder}/{n[: -len(COMMIT_SUFFIX)]}" if folder else n[: -len(COMMIT_SUFFIX)]
            try:
                out[name] = self.read_commit(name)
            except FileNotFoundError:
                continue  # deleted by retention since the listing
            except CorruptCheckpointError as e:
                bad.append(str(e))
        return out, bad

    def fulls(self) -> tuple[dict[int, Commit], list[str]]:
        """The committed full checkpoints by step, and the damaged commit objects."""
        found, bad = self.commits(layout.FULL_DIR)
        return {
            s: c for n, c in found.items() if (s := layout.parse_full_name(_base(n))) is not None
        }, bad

    def records(self) -> tuple[dict[tuple[int, int], Commit], list[str]]:
        """The committed record files by ``(first, last)``, and the damaged commit objects."""
        found, bad = self.commits(layout.RECORDS_DIR)
        return {
            r: c for n, c in found.items() if (r := layout.parse_records_name(_base(n))) is not None
        }, bad

    # ------------------------------------------------------------------ writing
    def put(self, local: Path, name: str, hook: Callable[[str], None] | None = None) -> Commit:
        """Upload the local file ``local`` as ``name`` and publish it; returns its commit.

        The bytes go to a data key of their own; the commit object is written only once
        the data object is complete and the remote reports its full size, then the data
        object of the commit it replaces (if any) is deleted. A failure at any point
        leaves the previous commit of ``name`` as it was. ``hook`` (tests) is called with
        ``"chunk"`` after each chunk written to the open remote file (for a file sent in
        one PUT: once, before it) and ``"commit"`` just before the commit is written.
        """
        token = uuid.uuid4().hex[:16]
        obj = f"{DATA_DIR}/{name}.{token}"
        self._makedirs(obj)
        size, digest = self.transfer.put(local, self.key(obj), hook)
        remote_size = int(self._info(obj)["size"])
        if remote_size != size:
            raise RemoteStorageError(
                f"{self.where(obj)}: the remote holds {remote_size} bytes after an upload of "
                f"{size}; not committed"
            )
        if hook is not None:
            hook("commit")
        old = None
        with contextlib.suppress(Exception):
            old = self.read_commit(name)
        commit = Commit(name, obj, size, digest)
        self._publish_small(name + COMMIT_SUFFIX, commit.encode())
        if old is not None and old.object != obj:
            with contextlib.suppress(Exception):
                self.fs.rm_file(self.key(old.object))
        return commit

    def _info(self, rel: str) -> dict[str, Any]:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.key(rel))
        return self.fs.info(self.key(rel))  # type: ignore[no-any-return]

    def _makedirs(self, rel: str) -> None:
        if self.local:  # object stores have no folders to make
            parent = self.key(rel).rsplit("/", 1)[0]
            self.fs.makedirs(parent, exist_ok=True)

    def _publish_small(self, rel: str, data: bytes) -> None:
        """Write a small object so that readers see the old bytes or the new, never a
        part: one PUT on an object store; a temp file, fsync and rename on a file system."""
        if not self.local:
            self.fs.pipe_file(self.key(rel), data)
            return
        path = Path(self.key(rel))
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path) as f:
            f.write(data)

    def delete(self, name: str) -> None:
        """Unpublish ``name``: its commit object first, then its data object."""
        try:
            c = self.read_commit(name)
        except FileNotFoundError:
            return
        except CorruptCheckpointError:
            c = None
        self.fs.rm_file(self.key(name + COMMIT_SUFFIX))
        if c is not None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.key(c.object))

    # ------------------------------------------------------------------ reading data
    def get(self, commit: Commit, dest: Path) -> None:
        """Download ``commit``'s data object to ``dest`` (published atomically), checking
        its size and checksum; :class:`CorruptCheckpointError` naming the object when
        they differ (``dest`` is then untouched)."""
        self.transfer.get(self.key(commit.object), dest, commit, self.where(commit.object))

    # ------------------------------------------------------------------ cleaning
    def clean(self) -> list[str]:
        """Delete what an interrupted writer left: data objects no commit names, commit
        temp files, and (S3) multipart uploads under this root. Returns what went.

        Only the one writer of this remote may call it (it holds the local directory's
        writer lock): an upload in flight is indistinguishable from a leftover.
        """
        referenced: set[str] = set()
        removed: list[str] = []
        for folder in ("", "full", "records"):
            found, _bad = self.commits(folder)
            referenced.update(c.object for c in found.values())
            for n in self._ls(folder):
                if n.startswith(TMP_MARK):
                    rel = f"{folder}/{n}" if folder else n
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(self.key(rel))
                        removed.append(rel)
        try:
            data = self.fs.find(self.key(DATA_DIR))
        except FileNotFoundError:
            data = []
        prefix = self.root + "/"
        for p in data:
            rel = str(p)[len(prefix) :] if str(p).startswith(prefix) else str(p)
            if rel not in referenced:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.key(rel))
                    removed.append(rel)
        removed += self._abort_multipart()
        return removed

    def _abort_multipart(self) -> list[str]:
        """Abort the S3 multipart uploads of this tier's data objects (none on other file
        systems). Only those under its own ``data/``: the tiers of a job's other shards
        live in folders below this one, and their writers upload concurrently."""
        if not hasattr(self.fs, "list_multipart_uploads"):
            return []
        bucket, _, prefix = self.root.partition("/")
        mine = f"{prefix}/{DATA_DIR}/" if prefix else f"{DATA_DIR}/"
        removed = []
        for up in self.fs.list_multipart_uploads(bucket):
            key = str(up.get("Key", ""))
            if not key.startswith(mine):
                continue
            self.fs.call_s3(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=up["UploadId"]
            )
            removed.append(f"multipart:{key}")
        return removed
