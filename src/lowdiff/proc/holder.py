"""Named shared memory and the descriptor of a process that may outlive its trainer.

A process that keeps state for the next trainer (LowDiff's writer, LowDiff+'s replica,
Gemini's holder) owns named segments: a *control block* (a header: magic, sequence
number, state, step; a JSON document: how a new trainer takes it over; LowDiff+'s
*arena* of state tensors and the step's metadata, as a full checkpoint's), the arena,
and the slots and counters made for a trainer that took it over; the descriptor ``DIR/.lowdiff.replica.json`` names the
control block, the run and the owner. Once its trainer is gone and it has handled all it
was sent, the process is an *orphan* (ORPHANED): the next trainer finds it
(:func:`find_orphan`) and takes it over (:mod:`lowdiff.engine.trainer.takeover`) or
releases it (:func:`release_orphan`). Segments of an owner that is gone are removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import torch

from lowdiff.errors import DirectoryLockedError, LowDiffError
from lowdiff.format.atomic import write_bytes_atomic
from lowdiff.format.dtypes import dtype_from_name, dtype_name
from lowdiff.format.sfile import TensorEntry, view_tensors
from lowdiff.proc import libc
from lowdiff.proc.child_end import pid_alive
from lowdiff.proc.locks import wait_for_writer

DESCRIPTOR = ".lowdiff.replica.json"
_MAGIC = b"LDREPL01"
_HDR = struct.Struct("<8sqqqq")  # magic, seq, state, step, json_len
CTL_BYTES = 4 << 20

# The only segment names lowdiff creates: a name read from a descriptor or a control block
# is used only in this form (a forged file cannot make lowdiff unlink anything else)
_SEGMENT_RE = re.compile(r"^lowdiff-[A-Za-z0-9_-]{1,100}$")


def valid_segment_name(name: object) -> bool:
    return isinstance(name, str) and _SEGMENT_RE.match(name) is not None


STATE_INIT, STATE_RUNNING, STATE_ORPHANED, STATE_CLOSED = 0, 1, 2, 3


def _untracked(shm: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    # Python's resource tracker would unlink the segment when the process that opened it
    # exits; the replica must outlive the trainer, so lowdiff unlinks it explicitly.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def ensure_shm_space(nbytes: int, what: str) -> None:
    """Raise a clear error instead of a bus error when /dev/shm cannot hold ``nbytes`` more."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return  # no /dev/shm to ask (not Linux): let the allocation speak for itself
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise LowDiffError(
            f"not enough shared memory for {what}: need {nbytes / 2**20:.1f} MiB, /dev/shm has "
            f"{free / 2**20:.1f} MiB free; enlarge it (e.g. `docker run --shm-size=...`)"
        )


def create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    ensure_shm_space(size, f"shared-memory segment {name}")
    return _untracked(shared_memory.SharedMemory(name=name, create=True, size=max(size, 1)))


def attach_segment(name: str) -> shared_memory.SharedMemory:
    return _untracked(shared_memory.SharedMemory(name=name, create=False))


def unlink_segment(name: str) -> None:
    """Remove a segment's name (the memory goes once every mapping is closed)."""
    import _posixshmem  # the segments are untracked, so SharedMemory.unlink() would double-unregister

    with contextlib.suppress(FileNotFoundError, OSError):
        _posixshmem.shm_unlink("/" + name.lstrip("/"))


def unlink_and_close(shm: shared_memory.SharedMemory) -> None:
    """Unlink a segment, then close this process's mapping (refused while tensors view
    it: the mapping then goes with them)."""
    unlink_segment(shm.name)
    with contextlib.suppress(Exception):
        shm.close()


def segment_tensor(shm: shared_memory.SharedMemory, nbytes: int) -> torch.Tensor:
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    assert shm.buf is not None
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range of a mapping in, writable, at once
_POPULATE_CHUNK = 2 << 20


def populate(shm: shared_memory.SharedMemory) -> bool:
    """Allocate and map every page of ``shm`` (best effort; the contents stay), so that
    the first writes take no page fault each: ``madvise(MADV_POPULATE_WRITE)`` 2 MiB at
    a time, through ctypes, which lets go of the GIL. False where the kernel cannot."""
    if not shm.size or not sys.platform.startswith("linux"):
        return False
    try:
        lib = libc()
        assert shm.buf is not None
        # held during the call: close() refuses while this export lives
        first = ctypes.c_char.from_buffer(shm.buf)
    except (OSError, AttributeError, TypeError, ValueError, BufferError):
        return False
    start, size = ctypes.addressof(first), shm.size
    for at in range(0, size, _POPULATE_CHUNK):
        # a call per chunk: each holds the address space's lock (a read lock, which an
        # allocation of the trainer's waits for) a short while only
        if lib.madvise(start + at, min(_POPULATE_CHUNK, size - at), _MADV_POPULATE_WRITE):
            return False
    return True


def populate_soon(segments: list[shared_memory.SharedMemory]) -> None:
    """:func:`populate` each of ``segments``, in order, on a thread: the caller goes on."""

    def run() -> None:
        for shm in segments:
            with contextlib.suppress(Exception):
                populate(shm)

    threading.Thread(target=run, daemon=True, name="lowdiff-populate").start()


def entries_to_json(entries: list[TensorEntry]) -> list[list[Any]]:
    return [[e.name, dtype_name(e.dtype), list(e.shape), e.start, e.end] for e in entries]


def entries_from_json(items: list[list[Any]]) -> list[TensorEntry]:
    return [
        TensorEntry(str(n), dtype_from_name(dt), tuple(int(s) for s in shape), int(a), int(b))
        for n, dt, shape, a, b in items
    ]


class ControlBlock:
    """Header + JSON in a named segment; written by the owner, read by a new trainer."""

    def __init__(self, shm: shared_memory.SharedMemory) -> None:
        self.shm = shm

    @property
    def _buf(self) -> memoryview:
        buf = self.shm.buf
        assert buf is not None
        return buf

    def write(self, state: int, step: int, doc: dict[str, Any]) -> None:
        self.write_raw(state, step, json.dumps(doc, separators=(",", ":")).encode())

    def write_raw(self, state: int, step: int, raw: bytes) -> None:
        """Publish an already-serialised JSON document."""
        if _HDR.size + len(raw) > self.shm.size:
            raise LowDiffError(
                f"replica metadata of {len(raw)} bytes does not fit the control block"
            )
        buf = self._buf
        _, seq, _, _, _ = _HDR.unpack_from(buf, 0)
        # seqlock: an odd sequence number means "being written"
        _HDR.pack_into(buf, 0, _MAGIC, seq + 1, state, step, len(raw))
        buf[_HDR.size : _HDR.size + len(raw)] = raw
        _HDR.pack_into(buf, 0, _MAGIC, seq + 2, state, step, len(raw))

    def set_step(self, state: int, step: int | None) -> None:
        """Publish a new state and step (None: the same), keeping the JSON document."""
        magic, seq, _, old, n = _HDR.unpack_from(self._buf, 0)
        step = old if step is None else step
        _HDR.pack_into(self._buf, 0, magic, seq + 1, state, step, n)
        _HDR.pack_into(self._buf, 0, magic, seq + 2, state, step, n)

    def set_state(self, state: int) -> None:
        self.set_step(state, None)

    def read(self) -> tuple[int, int, dict[str, Any]]:
        for _ in range(1000):
            magic, seq, state, step, n = _HDR.unpack_from(self._buf, 0)
            if magic != _MAGIC:
                raise LowDiffError("not a lowdiff replica control block")
            if seq % 2:
                time.sleep(0.001)
                continue
            raw = bytes(self._buf[_HDR.size : _HDR.size + n])
            if _HDR.unpack_from(self._buf, 0)[1] != seq:
                continue
            return state, step, json.loads(raw) if n else {}
        raise LowDiffError("replica control block is being rewritten continuously")


def read_control_block(name: str) -> tuple[int, int, dict[str, Any]]:
    """(state, step, document) of the control block ``name``, attached and closed again."""
    shm = attach_segment(name)
    try:
        return ControlBlock(shm).read()
    finally:
        shm.close()


@dataclass
class Descriptor:
    """What ``DIR/.lowdiff.replica.json`` says about the process that serves ``DIR``."""

    pid: int
    host: str
    run_id: str
    ctl: str
    layout_id: str
    directory: str = ""
    """The directory it was written in (:func:`directory_id`; empty: an older lowdiff's)."""
    process: str = ""
    """``"writer"``, ``"replica"``, ``"holder"``: what ``lowdiff inspect`` calls it."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def directory_id(root: Path) -> str:
    """``"<st_dev>:<st_ino>"`` of ``root``: the same for the directory under any path to
    it (a rename, a symlink), another for a copy of it."""
    st = os.stat(root)
    return f"{st.st_dev}:{st.st_ino}"


def write_descriptor(root: Path, d: Descriptor) -> None:
    d = replace(d, directory=directory_id(root))
    write_bytes_atomic(root / DESCRIPTOR, json.dumps(d.to_json(), sort_keys=True).encode())


def read_descriptor(root: Path) -> Descriptor | None:
    """The descriptor of the process that serves ``root``, or None: none, unreadable, or
    copied with the directory from another one (``cp -a`` while an orphan waits: that
    process serves the original, whose files and next trainer it belongs to)."""
    try:
        raw = json.loads((root / DESCRIPTOR).read_text())
        d = Descriptor(
            int(raw["pid"]), str(raw["host"]), str(raw["run_id"]), str(raw["ctl"]),
            str(raw["layout_id"]), str(raw.get("directory", "")), str(raw.get("process", "")),
        )  # fmt: skip
        if d.directory and d.directory != directory_id(root):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not valid_segment_name(d.ctl) or d.pid <= 0:
        return None
    return d


def remove_descriptor(root: Path, run_id: str | None = None) -> None:
    d = read_descriptor(root)
    if d is not None and (run_id is None or d.run_id == run_id):
        with contextlib.suppress(FileNotFoundError):
            (root / DESCRIPTOR).unlink()


@dataclass
class Orphan:
    """A process that outlived its trainer (LowDiff's writer, LowDiff+'s replica,
    Gemini's holder), found by :func:`find_orphan`: a new trainer takes it over or
    releases it."""

    descriptor: Descriptor
    ctl: ControlBlock
    state: int
    step: int
    doc: dict[str, Any]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ctl.shm.close()

    def release_owner(self, timeout: float = 60.0) -> None:
        """SIGTERM: the owner persists what it holds and exits; waited for ``timeout`` s."""
        self.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.descriptor.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(self.descriptor.pid) and time.monotonic() < deadline:
            time.sleep(0.02)


@dataclass
class LiveReplica(Orphan):
    """A replica found in memory, validated, ready to copy from."""

    arena: shared_memory.SharedMemory | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        assert self.arena is not None
        entries = entries_from_json(self.doc["entries"])
        size = entries[-1].end if entries else 0
        return view_tensors(entries, segment_tensor(self.arena, size))

    def close(self) -> None:
        if self.arena is not None:
            with contextlib.suppress(Exception):
                self.arena.close()
        super().close()


def find_orphan(
    root: Path, layout_id: str | None, wait_s: float = 30.0
) -> tuple[Orphan | None, str]:
    """The process of ``root`` that outlived its trainer, or (None, why not): its owner
    alive, its control block of the descriptor's run and ``layout_id`` (None: any, to
    release it), done with what its trainer sent (ORPHANED; waited for up to ``wait_s``
    seconds). Segments of a dead owner are stale: unlinked, never read."""
    d = read_descriptor(root)
    if d is None:
        return None, "no live replica"
    if d.host != socket.gethostname():
        why = f"the replica lives on host {d.host}; a replica is only attached on its own host"
        return None, why
    if not pid_alive(d.pid):
        cleanup_stale(root, d)
        why = f"the replica's checkpointing process (pid {d.pid}) is gone; stale segments removed"
        return None, why
    try:
        ctl_shm = attach_segment(d.ctl)
    except FileNotFoundError:
        return None, "the replica's control block is gone"
    ctl = ControlBlock(ctl_shm)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            state, step, doc = ctl.read()
        except (LowDiffError, ValueError) as e:
            ctl_shm.close()
            return None, f"unusable replica control block ({e})"
        if doc.get("run_id") != d.run_id or layout_id not in (None, doc.get("layout_id")):
            ctl_shm.close()
            why = "the shared memory belongs to another run or another model (stale); not attached"
            return None, why
        if state == STATE_ORPHANED:
            return Orphan(d, ctl, state, step, doc), "ok"
        if state == STATE_CLOSED or not pid_alive(d.pid) or time.monotonic() > deadline:
            ctl_shm.close()
            return None, f"the replica is not available (state {state})"
        time.sleep(0.002)  # the owner is still at what its trainer sent


def find_live_replica(
    root: Path, layout_id: str, wait_s: float = 30.0
) -> tuple[LiveReplica | None, str]:
    """The live replica of ``root`` (a :func:`find_orphan` that holds a state in its
    arena), or (None, why not)."""
    found, why = find_orphan(root, layout_id, wait_s)
    if found is None:
        return None, why
    return _with_arena(found)


def _with_arena(found: Orphan) -> tuple[LiveReplica | None, str]:
    """``found`` with the arena its control block names attached, or (None, why not;
    ``found`` closed)."""
    doc = found.doc
    if not valid_segment_name(doc.get("arena")):
        found.close()
        return None, "the replica's control block names an invalid arena segment"
    try:
        arena = attach_segment(doc["arena"])
    except FileNotFoundError:
        found.close()
        return None, "the replica's arena is gone"
    return LiveReplica(found.descriptor, found.ctl, found.state, found.step, doc, arena), "ok"


def peer_copy(live: LiveReplica) -> tuple[int, LiveReplica | None]:
    """The peer copy a LowDiff+ replica keeps of another rank's shard (in a job across
    nodes): (that rank, the copy ready to read from), or (-1, None) when it keeps none
    and (rank, None) when it has none to offer (never built, or no longer held)."""
    peer = live.doc.get("peer")
    if not isinstance(peer, dict) or not valid_segment_name(peer.get("ctl")):
        return -1, None
    rank = int(peer.get("rank", -1))
    try:
        ctl = ControlBlock(attach_segment(peer["ctl"]))
    except FileNotFoundError:
        return rank, None
    try:
        state, step, doc = ctl.read()
    except (LowDiffError, ValueError):
        ctl.shm.close()
        return rank, None
    if state != STATE_ORPHANED:
        ctl.shm.close()
        return rank, None
    return rank, _with_arena(Orphan(live.descriptor, ctl, state, step, doc))[0]


def orphan_waits(root: Path | None) -> bool:
    """Whether a live process of ``root`` (by its descriptor) may be taken over: the next
    trainer then need not start the process server ahead of time."""
    d = None if root is None else read_descriptor(root)
    return d is not None and d.host == socket.gethostname() and pid_alive(d.pid)


def orphan_idle(root: Path) -> bool:
    """Whether the process of ``root`` lives and is an orphan (ORPHANED: it has written
    everything its trainer sent)."""
    d = read_descriptor(root)
    if d is None or d.host != socket.gethostname() or not pid_alive(d.pid):
        return False
    try:
        state, _, doc = read_control_block(d.ctl)
    except (OSError, ValueError, LowDiffError):
        return False
    return state == STATE_ORPHANED and doc.get("run_id") == d.run_id


def wait_until_written(root: Path, timeout: float) -> None:
    """Wait until no process writes to ``root``: none holds its writer lock, or the one
    that does is an orphan (:func:`orphan_idle`); ``DirectoryLockedError`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not orphan_idle(root):
        try:
            wait_for_writer(root, min(0.2, max(0.0, deadline - time.monotonic())))
            return
        except DirectoryLockedError:
            if time.monotonic() > deadline:
                raise


def release_orphan(root: Path, wait_s: float) -> Descriptor | None:
    """Let the orphan of ``root`` (any layout) persist what it holds and exit, within
    ``wait_s`` seconds in all; its descriptor (for :func:`forget_released`), or None."""
    deadline = time.monotonic() + wait_s
    found, _ = find_orphan(root, None, wait_s)
    if found is None:
        return None
    found.release_owner(max(0.0, deadline - time.monotonic()))
    return found.descriptor


def forget_released(root: Path, d: Descriptor | None) -> None:
    """After a released process is gone (its writer lock free): remove what it left in
    shared memory (killed while it persisted) while its descriptor still names it."""
    if d is not None and not pid_alive(d.pid):
        cleanup_stale(root, d)


def cleanup_stale(root: Path, d: Descriptor) -> list[str]:
    """Remove every segment of a dead owner's run (control block, arenas of any generation,
    the slots made for a trainer that took it over) and its descriptor; the names removed."""
    prefix = f"lowdiff-{d.run_id[:16]}-"
    names = {d.ctl}
    with contextlib.suppress(OSError):
        names.update(
            n for n in os.listdir("/dev/shm") if n.startswith(prefix) and valid_segment_name(n)
        )
    with contextlib.suppress(Exception):
        _, _, doc = read_control_block(d.ctl)
        if doc.get("run_id") == d.run_id and valid_segment_name(doc.get("arena")):
            names.add(doc["arena"])
    for n in names:
        unlink_segment(n)
    remove_descriptor(root, d.run_id)
    return sorted(names)


def remove_stale_replica(root: Path) -> list[str]:
    """What a process of ``root`` that is gone (SIGKILLed) left in shared memory, removed;
    the segment names (a live one is left alone)."""
    d = read_descriptor(root)
    if d is None or pid_alive(d.pid):
        return []
    return cleanup_stale(root, d)


STATE_NAMES = {
    STATE_INIT: "starting", STATE_RUNNING: "running",
    STATE_ORPHANED: "waiting for a new trainer", STATE_CLOSED: "closing",
}  # fmt: skip


def replica_status(root: Path) -> dict[str, Any] | None:
    """What ``lowdiff inspect`` shows about the live replica (read-only), or None."""
    d = read_descriptor(root)
    if d is None:
        return None
    out: dict[str, Any] = {"pid": d.pid, "host": d.host, "run_id": d.run_id}
    if d.process:
        out["process"] = d.process
    if not pid_alive(d.pid):  # a dead owner's segments are never attached
        out["state"] = "stale (owner gone)"
        return out
    try:
        state, step, doc = read_control_block(d.ctl)
    except FileNotFoundError:
        out["state"] = "stale (no control block)"
        return out
    except (LowDiffError, ValueError):
        out["state"] = "unreadable"
        return out
    ours = doc.get("run_id") == d.run_id
    out["state"] = STATE_NAMES.get(state, str(state)) if ours else "stale (other run)"
    out["step"] = step
    # LowDiff's writer publishes the same block as LowDiff+'s replica
    out["process"] = doc.get("process", "replica")
    peer = doc.get("peer") if ours else None
    if isinstance(peer, dict) and valid_segment_name(peer.get("ctl")):
        with contextlib.suppress(FileNotFoundError, LowDiffError, ValueError):
            _, copy_step, _ = read_control_block(peer["ctl"])
            out["peer_copy"] = {"rank": int(peer.get("rank", -1)), "step": copy_step}
    return out
