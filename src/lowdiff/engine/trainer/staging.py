"""Full checkpoints: the state copied into a shared staging buffer and handed over.

The copy is the only part on the training process; the checkpointing process writes
the buffer (LowDiff) or builds its replica from it (LowDiff+). One staging buffer is
reused: a new full checkpoint waits until the process has released the previous one
(``STAGING_DONE``, see :mod:`lowdiff.proc.channel`).

From a CUDA device the buffer is page-locked and the copy runs on a side stream: the
message goes once the copy ended (:mod:`lowdiff.engine.trainer.pending`), and the
compute stream waits for the copy only before the next update
(:meth:`FullStager.before_update`), so the next forward and backward overlap it. The
copy reads the model's buffers from a copy of them made on the compute stream, since a
forward pass changes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from lowdiff.ddp.shard import shard_model_tensors
from lowdiff.engine.trainer.directory import CheckpointDir
from lowdiff.engine.trainer.handover import Handover
from lowdiff.engine.trainer.pending import DeviceToHost, fresh_copies
from lowdiff.engine.trainer.progress import Progress
from lowdiff.engine.trainer.session import ProcessSession
from lowdiff.engine.trainer.training import TrainingObjects, dumps
from lowdiff.engine.wire.messages import Full, Stage
from lowdiff.format import codec
from lowdiff.format.dtypes import dtype_name
from lowdiff.format.sfile import plan, view_tensors
from lowdiff.proc import channel
from lowdiff.proc import holder as rp
from lowdiff.proc.pinned import pin, unpin
from lowdiff.state import capture as st


class FullStager:
    """Stages full checkpoints of one session into a shared buffer.

    Args:
        objects: the training objects (what is staged).
        progress: the session's counters.
        directory: the checkpoint directory (the run a full checkpoint names).
        handover: sends now or, driven by the optimizer's hooks, once the scheduler stepped.
    """

    def __init__(
        self,
        objects: TrainingObjects,
        progress: Progress,
        directory: CheckpointDir,
        handover: Handover,
    ) -> None:
        self.objects, self.progress, self.directory = objects, progress, directory
        self.handover = handover
        self.observe_copy: Callable[[float], None] | None = None
        """Told the seconds each copy took (the ``"auto"`` planner), or None."""
        self.buffer: torch.Tensor | None = None
        self._plan: tuple[Any, list[Any], int] | None = None
        """A full checkpoint's layout: (the tensors' names, dtypes and shapes, entries, size)."""
        self._dsts: tuple[Any, Any, list[torch.Tensor]] | None = None
        """The staging buffer and layout the views were made for, and the views."""
        self.staged = 0
        """Stagings handed over (compared with the process's STAGING_DONE count)."""
        self.stages = 0
        """Staging buffers sent (compared with the process's STAGES_TAKEN count)."""
        self.taken = 0
        """Staging buffers the process is known to have taken."""
        self._unsent = False
        """A full checkpoint staged and deferred (driven by the optimizer's hooks), not
        sent yet: it holds the staging buffer until it is."""
        self._to_host: DeviceToHost | None = None
        self._copy_done: Any = None
        """From a CUDA device: the event of the last copy, until the next update waits for it."""
        self._pinned: torch.Tensor | None = None
        """The staging buffer page-locked, or None."""
        self._pin_tried: torch.Tensor | None = None
        """The staging buffer :func:`~lowdiff.proc.pinned.pin` was called for (once per
        buffer: it warns when it cannot)."""

    def reset(self, buffer: torch.Tensor | None = None) -> None:
        """A new checkpointing process: it needs the staging buffer sent again, unless
        it made ``buffer`` itself (a process taken over), which is then staged into."""
        if buffer is not self.buffer:
            self._let_go()
        self.buffer = buffer
        self.staged = 0
        self.stages = self.taken = 0

    def drop_when_released(self, session: ProcessSession) -> None:
        """Let go of the staging buffer once the process released it (a process sent
        only its first message through it: LowDiff+'s replica holds the state now)."""
        if self.buffer is not None and self.released(session):
            self._let_go()
            self.buffer = None

    def release(self) -> None:
        """Give back the page-locked staging buffer (the session ends)."""
        self._let_go()

    def _let_go(self) -> None:
        """Unpin the staging buffer before it is dropped or replaced."""
        if self._pinned is not None:
            unpin(self._pinned)  # waits for the device's copies into it
        self._pinned = self._pin_tried = None

    def before_update(self) -> None:
        """Make the device's compute stream wait for the copy of the last full checkpoint,
        if one is in flight: the update changes the parameters and optimizer state it
        reads. The host does not wait."""
        done, self._copy_done = self._copy_done, None
        if done is not None:
            torch.cuda.current_stream(self.objects.record_device).wait_event(done)

    def released(self, session: ProcessSession) -> bool:
        """Whether the process has released every staging handed to it."""
        return session.counter(channel.STAGING_DONE) >= self.staged

    def ensure_taken(self, session: ProcessSession) -> None:
        """Wait until the process took every staging buffer sent to it. Only the living
        trainer can hand one over (shared memory passed by descriptor): until then, a
        crash of the trainer would lose the state staged in it, and with the first full
        checkpoint of a new directory, every step after it. Once per buffer: nothing on
        every other step."""
        if self.taken >= self.stages:
            return
        session.wait(
            lambda: session.counter(channel.STAGES_TAKEN) >= self.stages,
            "the checkpointing process to take the staged state",
        )
        self.taken = self.stages

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The state's tensors (model, optimizer, RNG) and the metadata taken with them."""
        objects = self.objects
        assert objects.rng_layout is not None and objects.layout is not None
        msd, aliases = st.model_state(objects.model)
        if objects.dist is not None:
            msd = shard_model_tensors(msd, objects.foreign)
        otensors, ojson = objects.optimizer_state()
        rng_t, rng_extra = st.capture_rng(objects.rng_layout)
        tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in msd.items()}
        tensors.update(otensors)
        tensors.update(rng_t)
        meta = {
            "kind": "full",
            "run_id": self.directory.run_id,
            "layout_id": objects.layout_id,
            "model_aliases": codec.dumps(aliases),
            "optim": ojson,
            "rng": codec.dumps(rng_extra),
        }
        if objects.dist is not None:
            meta["shard"] = codec.dumps(objects.shard)
        if objects.peer_shard:  # LowDiff+'s copy of another node's shard starts here
            peer_tensors, meta["peer_optim"] = objects.peer_state()
            tensors.update(peer_tensors)
        return tensors, meta

    def _copy_in(
        self, session: ProcessSession, tensors: dict[str, torch.Tensor]
    ) -> tuple[list[Any], Any]:
        """(Re)make the buffer if too small, copy ``tensors`` in; the entries, and the
        event of the copy's end (None: the copy is done)."""
        sig = tuple((k, v.dtype, v.shape) for k, v in tensors.items())
        if self._plan is None or self._plan[0] != sig:
            # the layout changes only when the state's tensors do (optimizer state appears
            # after the first update; a parameter group is added)
            self._plan = (sig, *plan(sig))
        _, entries, size = self._plan
        if self.buffer is None or self.buffer.numel() < size:
            # grow with slack: optimizer state appears after the first step
            rp.ensure_shm_space(size + size // 8, "staging a full checkpoint")
            self._let_go()
            self.buffer = torch.empty(max(size, 1) + size // 8, dtype=torch.uint8).share_memory_()
            session.send(Stage(self.buffer), early=True)
            self.stages += 1
        dsts = self._dsts
        if dsts is None or dsts[0] is not self.buffer or dsts[1] is not entries:
            views = view_tensors(entries, self.buffer[:size])
            dsts = self._dsts = (self.buffer, entries, [views[k] for k, _, _ in sig])
        with torch.no_grad():
            return entries, self._copy(dsts[2], list(tensors.values()))

    def _copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
        """Copy the state into the staging buffer's views: on the CPU synchronously
        (None); from a CUDA device on a side stream (the event of its end), the CPU
        tensors (RNG states, step counters) synchronously."""
        dev = self.objects.record_device
        if dev is None or dev.type != "cuda":
            torch._foreach_copy_(dsts, srcs)
            return None
        assert self.buffer is not None
        if self._pin_tried is not self.buffer:
            self._pin_tried = self.buffer
            if pin(self.buffer):
                self._pinned = self.buffer
        on_host = [(d, s) for d, s in zip(dsts, srcs, strict=True) if not s.is_cuda]
        if on_host:
            torch._foreach_copy_([d for d, _ in on_host], [s for _, s in on_host])
        buffers = {b.data_ptr() for b in self.objects.buffer_refs.tensors() if b.is_cuda}
        dev_dsts: list[torch.Tensor] = []
        dev_srcs: list[torch.Tensor] = []
        changing: list[int] = []
        for d, s in zip(dsts, srcs, strict=True):
            if s.is_cuda:
                if s.data_ptr() in buffers:
                    changing.append(len(dev_srcs))
                dev_dsts.append(d)
                dev_srcs.append(s)
        # the next forward pass changes the buffers: the copy reads a copy of them
        for i, copy in zip(changing, fresh_copies([dev_srcs[i] for i in changing]), strict=True):
            dev_srcs[i] = copy
        if self._to_host is None:
            self._to_host = DeviceToHost(dev)
        done = self._to_host.copy(dev_dsts, dev_srcs, non_blocking=self._pinned is self.buffer)
        self._copy_done = done
        return done

    def emit(self, session: ProcessSession, step: int, message: type[Full] = Full) -> None:
        """Stage the state at ``step`` and hand it over as ``message`` (``Full`` for
        LowDiff's writer, ``Init`` for LowDiff+'s replica)."""
        objects, handover = self.objects, self.handover
        if self._unsent:
            # the previous full checkpoint, still deferred (not sent), holds the staging
            # buffer: send it now. Otherwise this step's record stays deferred until the
            # user's scheduler has stepped (sending it now would record the scheduler a
            # step behind).
            handover.finish()
        tensors, meta = self._state()
        meta["step"] = str(step)
        t0 = time.perf_counter()
        copies = handover.copies
        copies.poll()
        if not self.released(session):
            copies.send_all()  # the previous full checkpoint's message may wait for its copy
            session.wait(
                lambda: self.released(session),
                "the previous full checkpoint to release the staging buffer",
            )
        t1 = time.perf_counter()
        entries, done = self._copy_in(session, tensors)
        t2 = time.perf_counter()
        extra, live = self.progress.extra_at(step, objects.extra)
        entries_json = [
            [e.name, dtype_name(e.dtype), list(e.shape), e.start, e.end] for e in entries
        ]
        self.staged += 1

        def send() -> None:
            self._unsent = False
            if handover.deferred:
                # the hyperparameters the scheduler set since the copy (the state tensors
                # are unchanged: no update ran in between)
                meta["optim"] = objects.optimizer_state()[1]
            meta["scheduler"] = st.scheduler_state_json(objects.scheduler)
            if extra is not None:
                meta["extra"] = dumps(extra)
            msg = message(step, entries_json, meta)
            copies.submit(step, done, lambda: session.send(msg, early=True))

        self._unsent = True
        handover.handover(send, extra if live else None)  # a recovered tree is final
        stats = self.progress.stats
        stats["fulls_requested"] += 1
        stats["full_wait_s"] += t1 - t0
        stats["full_copy_s"] += t2 - t1
        self.progress.full_staged(step)
        if self.observe_copy is not None:
            self.observe_copy(t2 - t1)
