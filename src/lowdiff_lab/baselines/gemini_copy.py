"""Gemini's copy of a checkpoint into its holder's buffers, overlapped with training.

When a checkpoint is due after update ``s``, what forward or backward may change
(buffers such as BatchNorm statistics, the RNG states, hyperparameters) is copied into
the buffer before ``step()`` returns. Parameters and optimizer state change only in the
next optimizer update, so a background thread (one for the session) copies them while
the next forward and backward run, then hands the checkpoint to the holder and, under
DDP, sends it along the ring (:mod:`lowdiff_lab.baselines.gemini_ring`). ``step()`` waits for
that copy just before the next update.

Call sequence (trainer's thread, then the copy thread)::

    copy.start(step)    # (trainer) buffers, RNG, hyperparameters -> job queued
                        # (thread) parameters, optimizer state -> GmDone -> [ring]
    copy.wait_local()   # (trainer) before the next update: the local copy is complete
    copy.join()         # (trainer) before the next checkpoint: the whole job is over
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from lowdiff.errors import CheckpointWorkerError
from lowdiff.format import codec
from lowdiff.format.sfile import TensorEntry, plan, view_tensors
from lowdiff.proc import holder as rp
from lowdiff.state import capture as st
from lowdiff_lab.baselines.gemini_link import HolderLink
from lowdiff_lab.baselines.gemini_protocol import (
    N_BUFFERS,
    OWN,
    PEER,
    GmDone,
    GmPeerDone,
    other_buffer,
)
from lowdiff_lab.baselines.gemini_ring import PeerRing


@dataclass
class CopyJob:
    """One checkpoint's copy: the thread's inputs, and what it reports."""

    step: int
    seq: int
    buffer: int
    views: dict[str, torch.Tensor]
    deferred: list[tuple[str, torch.Tensor]]
    entries: list[list[Any]]
    meta: dict[str, str]
    blob: torch.Tensor
    peer: tuple[int, torch.Tensor] | None
    local: threading.Event = field(default_factory=threading.Event)
    """Set once the local copy is handed over (or failed): the next update may run."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the job is over, peer transfer included."""
    error: BaseException | None = None
    copy_s: float = 0.0
    peer_s: float = 0.0


@dataclass
class _Layout:
    """Where each tensor of a checkpoint lies in a buffer (it changes only when the
    optimizer creates its state, after step 1)."""

    key: tuple[Any, ...]
    entries: list[TensorEntry]
    size: int
    entries_json: list[list[Any]]


class CopyWorker:
    """Copies the training state into the holder's buffers (see the module docstring).

    Args:
        model, optimizer, scheduler: the live training objects.
        rng_layout: how the RNG states are captured.
        layout_id: the model's layout, recorded in each checkpoint's metadata.
        holder: the link to the holder that owns the buffers.
        ring: the ring of ranks under DDP (None, or inactive: no peer copies).
        stats: the checkpointer's counters (``copy_s``, ``copy_wait_s``, ``sync_copy_s``,
            ``memory_bytes``, ``peer_bytes``, ``peer_s``), updated here.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        rng_layout: st.RngLayout,
        layout_id: str,
        holder: HolderLink,
        ring: PeerRing | None,
        stats: dict[str, float],
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rng_layout, self.layout_id = rng_layout, layout_id
        self.holder = holder
        self.ring = ring if ring is not None and ring.active else None
        self.stats = stats
        self.job: CopyJob | None = None
        """The newest job (None once it was joined with an error, or stopped)."""
        self._param_names = {n for n, _ in st.unwrap_model(model).named_parameters()}
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._layout: _Layout | None = None
        self._views: list[tuple[_Layout, str | None, dict[str, torch.Tensor]] | None]
        self._views = [None] * N_BUFFERS

    # ------------------------------------------------------------------ trainer's thread
    def start(self, step: int) -> None:
        """Copy what may change before the next update; queue the rest for the thread.

        The previous job must be joined and acknowledged by the holder (its buffers are
        reused here)."""
        t0 = time.perf_counter()
        tensors, meta = self._capture(step)
        lay = self._layout_of(tensors)
        b = other_buffer(OWN, self.holder.cur)
        blob = self.holder.buffer(b, lay.size)
        peer = None
        if self.ring is not None:
            # DDP replicas have the same layout: the predecessor's checkpoint has this size
            pb = other_buffer(PEER, self.holder.peer_cur)
            peer = (pb, self.holder.buffer(pb, lay.size))
        views = self._views_of(b, lay, blob)
        deferred: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for k, v in tensors.items():
                if (k.startswith("model/") and k[len("model/") :] in self._param_names) or (
                    k.startswith("optim/state")
                ):
                    deferred.append((k, v.detach()))  # changes only in the next update
                else:
                    views[k].copy_(v.detach())
        seq = self.holder.next_seq()
        if peer is not None:
            self.holder.next_seq()  # the peer copy's, acknowledged apart
        job = CopyJob(step, seq, b, views, deferred, lay.entries_json, meta, blob, peer)
        # only now are these the newest: a failure above left the holder's own untouched
        self.holder.cur = b
        if peer is not None:
            self.holder.peer_cur = peer[0]
        self.job = job
        self.stats["sync_copy_s"] += time.perf_counter() - t0
        self.stats["memory_bytes"] += lay.size
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="lowdiff-gemini-copy", daemon=True
            )
            self._thread.start()
        self._jobs.put(job)

    def _capture(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The live tensors of the state after ``step`` updates, and its metadata."""
        msd, aliases = st.model_state(self.model)
        otensors, ojson = st.optimizer_state_tensors(self.optimizer)
        rng_t, rng_extra = st.capture_rng(self.rng_layout)
        tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in msd.items()}
        tensors.update(otensors)
        tensors.update(rng_t)
        meta = {
            "kind": "full",
            "step": str(step),
            "layout_id": self.layout_id,
            "model_aliases": codec.dumps(aliases),
            "optim": ojson,
            "scheduler": st.scheduler_state_json(self.scheduler),
            "rng": codec.dumps(rng_extra),
        }
        return tensors, meta

    def _layout_of(self, tensors: dict[str, torch.Tensor]) -> _Layout:
        key = tuple((k, v.dtype, v.shape) for k, v in tensors.items())
        if self._layout is None or self._layout.key != key:
            entries, size = plan((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
            self._layout = _Layout(key, entries, size, rp.entries_to_json(entries))
        return self._layout

    def _views_of(self, b: int, lay: _Layout, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of buffer ``b`` laid out as ``lay`` (kept while both stay the same)."""
        name = self.holder.bufs.names[b]
        cached = self._views[b]
        if cached is not None and cached[0] is lay and cached[1] == name:
            return cached[2]
        views = view_tensors(lay.entries, blob)
        self._views[b] = (lay, name, views)
        return views

    def wait_local(self) -> None:
        """Before the next update: wait for the local copy in flight; raise its error."""
        job = self.job
        if job is not None and not job.local.is_set():
            t0 = time.perf_counter()
            job.local.wait()
            self.stats["copy_wait_s"] += time.perf_counter() - t0
        if job is not None and job.error is not None:
            self._raise(job)

    def join(self) -> None:
        """Wait until the job in flight is over (peer transfer included); raise its error."""
        job = self.job
        if job is None:
            return
        job.done.wait()
        self.stats["copy_s"] += job.copy_s
        self.stats["peer_s"] += job.peer_s
        job.copy_s = job.peer_s = 0.0
        if job.error is not None:
            self._raise(job)

    def raise_error(self) -> None:
        """Raise the error of a local copy that is over, if it failed."""
        job = self.job
        if job is not None and job.local.is_set() and job.error is not None:
            self._raise(job)

    def _raise(self, job: CopyJob) -> None:
        # a copy fails when its holder does: the holder's own error says why
        self.holder.check()
        err, job.error = job.error, None
        self.job = None
        raise CheckpointWorkerError(
            f"the in-memory checkpoint of step {job.step} failed: {type(err).__name__}: {err}",
            "".join(traceback.format_exception(err)) if err is not None else "",
        ) from err

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the job in flight, then end the thread."""
        job, self.job = self.job, None
        if job is not None:
            job.done.wait(timeout)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None
        self._views = [None] * N_BUFFERS

    # ------------------------------------------------------------------ the copy thread
    def _run(self) -> None:
        """(thread) Run the copy jobs, one at a time, until None arrives."""
        while (job := self._jobs.get()) is not None:
            self._copy(job)

    def _copy(self, job: CopyJob) -> None:
        """(thread) Parameters and optimizer state into the buffer, then hand it over."""
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                for k, v in job.deferred:
                    job.views[k].copy_(v)
            job.deferred = []
            job.copy_s = time.perf_counter() - t0
            self.holder.hand_over(GmDone(job.seq, job.buffer, job.step, job.entries, job.meta))
            job.local.set()
            if job.peer is not None:
                t1 = time.perf_counter()
                self._send_to_peer(job)
                job.peer_s = time.perf_counter() - t1
        except BaseException as e:  # noqa: BLE001 -- raised on the trainer's next call
            job.error = e
        finally:
            job.views = {}
            job.local.set()
            job.done.set()

    def _send_to_peer(self, job: CopyJob) -> None:
        """(thread, DDP) Send this checkpoint to the successor, receive the predecessor's."""
        assert self.ring is not None and job.peer is not None
        pb, pblob = job.peer
        doc = self.ring.exchange(
            job.step, job.blob, {"entries": job.entries, "meta": job.meta}, pblob
        )
        self.holder.hand_over(
            GmPeerDone(job.seq + 1, pb, job.step, self.ring.prev, doc["entries"], doc["meta"])
        )
        self.stats["peer_bytes"] += job.blob.numel()
