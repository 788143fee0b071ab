"""CheckFreq's persist process: phase 2 of its checkpoint, and the messages it takes.

Spawned once per session by the trainer (:class:`lowdiff.proc.link.ProcessLink`) and fed
through its request pipe:

0) (process) takes ``DIR/.lowdiff.writer.lock``, reports :class:`~lowdiff.proc.protocol.Ready`;
1) (trainer) :class:`CfStage`: the shared snapshot buffer, once per size (a larger
   state sends a larger one, with the next generation number);
2) (trainer) :class:`CfPersist`, once the snapshot in the buffer is complete: the
   process writes the state with ``torch.save`` straight from the buffer, publishes it
   with its commit file, applies retention (``keep_full``) and answers :class:`CfDone`:
   the step is durable;
3) (trainer) :class:`~lowdiff.proc.protocol.Close`: answered with
   :class:`~lowdiff.proc.protocol.Closed`, then the process exits.

An exception ends the process with :class:`~lowdiff.proc.protocol.Failed`, raised again in
the trainer. A trainer that dies leaves a process that still writes a snapshot it was
handed (it is sent only once complete), then exits; the next session waits for its lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

import torch

from lowdiff.format import layout
from lowdiff.format.atomic import fault_point
from lowdiff.proc.child_end import ChildEnd
from lowdiff.proc.locks import acquire_flock
from lowdiff.proc.protocol import Close, Closed, Kind, Message, unexpected
from lowdiff.proc.spawn import detach_from_trainer_group
from lowdiff_lab.baselines.checkfreq_layout import Entry, rebuild
from lowdiff_lab.baselines.files import commit_path, published, save_state
from lowdiff_lab.baselines.torch_save import PREFIX, SUFFIX

# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class CfStage(Message):
    """trainer -> process: the snapshot buffer to read from now on."""

    kind: ClassVar[Kind] = Kind.CF_STAGE
    gen: int
    """Generation of the buffer (grows with every new buffer)."""
    blob: torch.Tensor = field(repr=False)
    """Shared uint8 memory holding every tensor of a snapshot."""


@dataclass(frozen=True)
class CfPersist(Message):
    """trainer -> process: the snapshot of ``step`` is complete in buffer ``gen``."""

    kind: ClassVar[Kind] = Kind.CF_PERSIST
    gen: int
    step: int
    entries: list[Entry] = field(repr=False)
    """Where each leaf of the skeleton lies in the buffer."""
    skeleton: dict[str, Any] = field(repr=False)
    """The state with a :class:`~lowdiff_lab.baselines.checkfreq_layout.Leaf` per tensor."""


@dataclass(frozen=True)
class CfDone(Message):
    """process -> trainer: ``step`` is published (durable)."""

    kind: ClassVar[Kind] = Kind.CF_DONE
    step: int
    nbytes: int
    """Bytes of the file written."""
    seconds: float
    """Time the persist took (rebuild, write, commit, retention)."""
    removed: int
    """Older checkpoints deleted by retention."""


@dataclass(frozen=True)
class PersistConfig:
    """What the persist process is started with."""

    root: str
    keep_full: int | None


# --------------------------------------------------------------------------- the process


def retain_files(directory: Path, keep: int | None) -> int:
    """Delete checkpoints beyond the newest ``keep`` (commit file first); returns how many."""
    if keep is None:
        return 0
    files = published(directory, PREFIX, SUFFIX)
    doomed = files[: max(0, len(files) - keep)]
    for _, p in doomed:
        for q in (commit_path(p), p):  # without its commit file a checkpoint is never read
            with contextlib.suppress(FileNotFoundError):
                q.unlink()
        fault_point("retention", p)
    return len(doomed)


class Persister:
    """The persist process's state: the snapshot buffer it was handed, and the writes."""

    def __init__(self, cfg: PersistConfig, end: ChildEnd) -> None:
        self.dir = Path(cfg.root) / layout.FULL_DIR
        self.keep_full = cfg.keep_full
        self.end = end
        self.gen = -1
        self.blob: torch.Tensor | None = None
        self.buf: Any = None
        self.durable = -1

    def tensors(self, entries: list[Entry]) -> list[torch.Tensor]:
        """Tensors over the shared buffer, each with a storage of its own (no copy), so
        that ``torch.save`` writes exactly the bytes that ``method="torch-save"`` does."""
        out = []
        for start, end, dtype, shape in entries:
            numel = math.prod(shape)
            if numel == 0:
                out.append(torch.empty(shape, dtype=dtype))
            else:
                assert end - start == numel * torch.empty((), dtype=dtype).element_size()
                t = torch.frombuffer(self.buf, dtype=dtype, count=numel, offset=start)
                out.append(t.view(shape))
        return out

    def persist(self, msg: CfPersist) -> None:
        """Write the snapshot of ``msg.step`` from the buffer, publish it, apply retention."""
        if msg.gen != self.gen:
            raise RuntimeError(
                f"snapshot of step {msg.step} refers to buffer {msg.gen}, the process holds {self.gen}"
            )
        t0 = time.perf_counter()
        state = rebuild(msg.skeleton, self.tensors(msg.entries))
        nbytes = save_state(self.dir / f"{PREFIX}{msg.step:012d}{SUFFIX}", state, step=msg.step)
        removed = retain_files(self.dir, self.keep_full)
        self.durable = max(self.durable, msg.step)
        self.end.send(CfDone(msg.step, nbytes, time.perf_counter() - t0, removed))

    def handle(self, msg: Message) -> bool:
        """Handle one request; returns False when the process should stop."""
        match msg:
            case CfStage():
                self.gen, self.blob = msg.gen, msg.blob
                self.buf = (ctypes.c_char * msg.blob.numel()).from_address(msg.blob.data_ptr())
            case CfPersist():
                self.persist(msg)
            case Close():
                self.end.send(Closed(self.durable))
                return False
            case _:
                raise unexpected(msg)
        return True

    def handle_orphaned(self, msg: Message) -> bool:
        """:meth:`handle` after the trainer died: write what can still be written."""
        with contextlib.suppress(Exception):  # nobody is left to report an error to
            return self.handle(msg)
        return True


def persist_main(cfg: PersistConfig, requests: Connection, results: Connection) -> None:
    """Entry point of the persist process (it ends the process when done)."""
    detach_from_trainer_group()
    torch.set_num_threads(1)  # leave the cores to training
    end = ChildEnd(requests, results)
    p = Persister(cfg, end)
    lock_fd = None
    code = 0
    try:
        lock_fd = acquire_flock(Path(cfg.root) / layout.WRITER_LOCK_FILE, blocking=True)
        end.ready()
        if end.serve(p.handle):
            # The trainer died without close(): a snapshot it handed over is complete
            # (it is sent only once copied), so it is still written.
            end.drain(p.handle_orphaned, (Kind.CF_STAGE, Kind.CF_PERSIST))
    except BaseException as e:  # noqa: BLE001 -- sent back and raised in the trainer
        end.failed(e)
        code = 1
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    # Every file is fsynced and every answer sent: skip the interpreter's teardown (with
    # torch loaded it takes longer than a small checkpoint), which close() would wait for.
    os._exit(code)
