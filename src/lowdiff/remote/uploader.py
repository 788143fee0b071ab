"""The uploader: a thread of the checkpointing process that copies its files to the remote.

The writer hands over each file it has published (:meth:`Uploader.submit`), in the order
it published them; the thread uploads them one at a time through
:meth:`lowdiff.remote.store.RemoteStore.put` (bandwidth cap included) and, after each
commit, computes the newest step the remote tier can recover (its durable step: from a
committed full checkpoint through committed record files without a gap) and reports it.
It never blocks the writer: a failed upload (an endpoint that does not answer, an error
of the store) is reported and retried with a growing pause, and the local tier goes on.
What is committed, the durable step and the remote's retention are kept by its
:class:`~lowdiff.remote.ledger.RemoteLedger`.

On start it cleans what a crashed writer left on the remote (:meth:`RemoteStore.clean`)
and catches up: every local full checkpoint and record file that the remote lacks, or
holds with other bytes, is queued; those it holds already count as committed. The files
waiting for upload are :meth:`Uploader.protected` from local retention, so the remote
tier never misses a file the local one has deleted; the remote's own retention keeps the
newest ``keep_full`` committed full checkpoints and the record files that reach them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import xxhash

from lowdiff.format import layout
from lowdiff.format.atomic import fault_point
from lowdiff.remote.commit import Commit
from lowdiff.remote.ledger import RemoteLedger
from lowdiff.remote.store import RemoteStore

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
"""Pauses between attempts of a failed upload (doubling from the first to the most)."""


def file_hash(path: Path) -> tuple[int, str]:
    """Size and xxh3-64 of a local file."""
    h = xxhash.xxh3_64()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


class Uploader:
    """Uploads the files of the checkpoint directory ``root`` to ``url`` in a thread.

    Args:
        root: the local checkpoint directory (the writer's).
        url, options, bandwidth: see :class:`lowdiff.remote.store.RemoteStore`.
        keep_full: the remote tier's retention (as the local one's), or None.
        tier: in a distributed job, ``root``'s folder in the job directory
            (``"rank-00001"``, ``"gen-2/rank-00001"``); ``url`` is then the job's remote
            tier and ``root``'s goes to ``url/tier``. ``""``: ``root`` is the directory.
        publishes: folders of the job (``""``: the job directory) whose manifest this
            uploader also publishes, before any file of its own (rank 0's share).
        siblings: the folders of every shard of ``root``'s generation (``tier`` among
            them): remote retention keeps the newest full checkpoint all of them have
            committed, as local retention does for the local shards.
        on_durable: called with the remote durable step whenever it grows.
        on_progress: called after each chunk sent and each commit (a heartbeat).
        on_error: called with a description of each failed attempt.
    """

    def __init__(
        self,
        root: Path,
        url: str,
        options: dict[str, Any] | None,
        *,
        keep_full: int | None,
        bandwidth: float | None = None,
        on_durable: Callable[[int], None] = lambda _s: None,
        on_progress: Callable[[], None] = lambda: None,
        on_error: Callable[[str], None] = lambda _e: None,
        tier: str = "",
        publishes: tuple[str, ...] = (),
        siblings: tuple[str, ...] = (),
    ) -> None:
        self.root, self.url, self.options = root, url, options
        self.tier, self.publishes, self.siblings = tier, publishes, siblings
        self.job_root = root
        for _ in PurePosixPath(tier).parts:
            self.job_root = self.job_root.parent
        self.keep_full, self.bandwidth = keep_full, bandwidth
        self.on_progress, self.on_error = on_progress, on_error
        self.cond = threading.Condition()
        self.queue: list[str] = []
        self.inflight: str | None = None
        self.ready = False
        """Cleaning and catch-up are done (the queue holds everything the remote lacks)."""
        self.stopping = False
        self.ledger = RemoteLedger(on_durable)
        """What the remote tier holds committed, and its durable step."""
        self.uploaded = 0
        self.uploaded_bytes = 0
        self.upload_s = 0.0
        self.last_error: str | None = None
        self.last_progress = time.monotonic()
        self._manifests: dict[str, bytes] = {}
        """The manifest bytes last published, by the URL of their tier."""
        self._sent = 0
        """Bytes sent by the current attempt at the current file."""
        self._high = 0
        """The most any attempt at the current file has sent."""
        self.store: RemoteStore | None = None
        """``root``'s tier (``url/tier``)."""
        self.job_store: RemoteStore | None = None
        """The tier at ``url`` (the job's, in a distributed job; else ``store``)."""
        self.thread = threading.Thread(target=self._run, name="lowdiff-upload", daemon=True)

    @property
    def durable(self) -> int:
        """The newest step the remote tier can recover (-1: none yet)."""
        return self.ledger.durable

    # ------------------------------------------------------------------ the writer's side
    def start(self) -> None:
        self.thread.start()

    def submit(self, path: Path) -> None:
        """Queue the local file ``path`` (under ``root``), just published."""
        name = path.relative_to(self.root).as_posix()
        with self.cond:
            if name not in self.queue:
                self.queue.append(name)
            self.cond.notify_all()

    def protected(self) -> set[Path]:
        """The local files not uploaded yet (local retention must keep them)."""
        with self.cond:
            names = list(self.queue) + ([self.inflight] if self.inflight else [])
            if not self.ready:  # the catch-up has not listed them yet: keep everything
                return {
                    p
                    for d in (layout.FULL_DIR, layout.RECORDS_DIR)
                    for p in (self.root / d).glob("*")
                }
        return {self.root / n for n in names}

    def idle(self) -> bool:
        with self.cond:
            return self.ready and not self.queue and self.inflight is None

    def drain(self, timeout: float, beat: Callable[[], None] = lambda: None) -> bool:
        """Wait until everything submitted is committed, as long as an upload makes
        progress within ``timeout`` seconds; calls ``beat`` while it waits. Returns
        whether the queue is empty."""
        with self.cond:
            self.last_progress = time.monotonic()
            while not (self.ready and not self.queue and self.inflight is None):
                if time.monotonic() - self.last_progress > timeout:
                    return False
                self.cond.wait(0.05)
                beat()
        return True

    def stop(self) -> None:
        """Let the thread end after its current attempt (it is a daemon either way)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    # ------------------------------------------------------------------ the thread
    def _chunk(self, n: int) -> None:
        """A chunk of the current attempt was sent. Progress only past what an earlier
        attempt at the same file sent: a retry that fails at the same point again (a
        server that is gone) is no progress, and the waits on the remote end."""
        self._sent += n
        if self._sent > self._high:
            self._high = self._sent
            self._progress()

    def _progress(self) -> None:
        self.last_progress = time.monotonic()
        self.on_progress()

    def _failed(self, what: str, e: BaseException) -> None:
        self.last_error = f"{what}: {type(e).__name__}: {e}"
        self.on_error(self.last_error)

    def _retrying(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` until it succeeds (None once the uploader stops)."""
        pause = RETRY_FIRST_S
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 -- any failure of the store is retried
                self._failed(what, e)
            with self.cond:
                if self.stopping:
                    return None
                self.cond.wait(pause)
            pause = min(pause * 2, RETRY_MAX_S)

    def _run(self) -> None:
        self.job_store = self._retrying(
            f"connecting to {self.url}",
            lambda: RemoteStore(
                self.url, self.options, bandwidth=self.bandwidth, progress=self._chunk
            ),
        )
        if self.job_store is not None:
            self.store = self.job_store.sub(self.tier)
        if (
            self.store is None
            or self._retrying(f"catching up with {self.url}", self._catch_up) is None
        ):
            return
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                name = self.inflight = self.queue.pop(0)
                self._high = 0
            try:
                done = self._retrying(
                    f"uploading {name} to {self.url}", functools.partial(self._upload, name)
                )
                if done is None:
                    return
            finally:
                with self.cond:
                    self.inflight = None
                    self.cond.notify_all()

    def _catch_up(self) -> bool:
        """Clean the remote, then queue the local files it lacks (oldest first)."""
        store, job = self.store, self.job_store
        assert store is not None and job is not None
        for rel in self.publishes:  # the job's own folders hold its manifests alone
            job.sub(rel).clean()
        store.clean()
        known: dict[str, Commit] = {}
        for folder in (layout.FULL_DIR, layout.RECORDS_DIR):
            known.update(store.commits(folder)[0])
        missing: list[tuple[int, str]] = []
        for folder in (layout.FULL_DIR, layout.RECORDS_DIR):
            for p in (self.root / folder).glob("*.safetensors"):
                step = _first_step(p.name)
                if step is None:
                    continue
                name = f"{folder}/{p.name}"
                c = known.get(name)
                try:
                    same = c is not None and (c.size, c.xxh3) == file_hash(p)
                except FileNotFoundError:
                    continue
                if same:
                    self.ledger.committed(name)
                else:
                    missing.append((step, name))
        self._upload_manifest()
        with self.cond:
            queued = [n for _s, n in sorted(missing)]
            self.queue[:0] = [n for n in queued if n not in self.queue]
            self.ready = True
            self.cond.notify_all()
        self.ledger.report()
        return True

    def _upload_manifest(self) -> None:
        """Upload the manifests that changed since their last upload: the job's
        (``publishes``) first, then that of ``root``."""
        assert self.store is not None and self.job_store is not None
        for rel in self.publishes:
            self._publish_manifest(self.job_root / rel, self.job_store.sub(rel))
        self._publish_manifest(self.root, self.store)

    def _publish_manifest(self, local: Path, store: RemoteStore) -> None:
        path = local / layout.MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        if raw == self._manifests.get(store.url):
            return
        with contextlib.suppress(FileNotFoundError):
            c = store.read_commit(layout.MANIFEST)
            if (c.size, c.xxh3) == (len(raw), xxhash.xxh3_64_hexdigest(raw)):
                self._manifests[store.url] = raw
                return
        store.put(path, layout.MANIFEST)
        self._manifests[store.url] = raw

    def _upload(self, name: str) -> bool:
        store = self.store
        assert store is not None
        local = self.root / name
        if not local.exists():
            return True  # gone (a later session quarantined it): nothing to publish
        if name.startswith(layout.FULL_DIR + "/"):
            self._upload_manifest()  # a reader of the remote needs the manifest first
        fault_point("before_upload", local)
        self._sent = 0
        t0 = time.perf_counter()
        commit = store.put(local, name, hook=lambda stage: fault_point(_POINTS[stage], local))
        self.upload_s += time.perf_counter() - t0
        self.uploaded += 1
        self.uploaded_bytes += commit.size
        self.ledger.committed(name)
        if name.startswith(layout.FULL_DIR + "/") and self.keep_full is not None:
            self.ledger.retain(store, self.keep_full, self.job_store, self.siblings)
        self.ledger.report()
        self._progress()
        return True


_POINTS = {"chunk": "upload_chunk", "commit": "before_commit"}
"""The fault-hook point (:mod:`lowdiff.format.atomic`) of each stage of an upload."""


def _first_step(name: str) -> int | None:
    """The step a full checkpoint or record file starts at, from its name."""
    s = layout.parse_full_name(name)
    if s is not None:
        return s
    r = layout.parse_records_name(name)
    return None if r is None else r[0]
