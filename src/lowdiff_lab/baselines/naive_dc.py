"""``method="naive-dc"``: the LowDiff paper's "Naïve DC" baseline.

Synchronous, dense differential checkpointing as the LowDiff paper constructs it (its
own baseline, not a reimplementation of Check-N-Run): a full checkpoint every
``full_every`` steps (and at step 0), and in between, every ``diff_every`` steps, a *differential* checkpoint of the state
against the previous checkpoint. Unlike LowDiff, which logs the compressed gradients
that training already computed, Naïve DC computes the differences itself, compresses
them itself and moves the (uncompressed) optimizer differences as well. That extra work
is the cost this baseline exists to measure, so it is done for real, every checkpoint,
on the training side (on the parameters' device), before the hand-off.

What a differential holds (the state after ``step`` updates, relative to ``base_step``,
the previous checkpoint):

- model parameters: ``top-k(P_step - B)`` with :class:`lowdiff.compressors.TopK` at
  ``ratio`` (no error feedback); ``B`` is the CPU copy of what a recovery reconstructs
  at ``base_step``, kept by the trainer and updated with exactly the arithmetic recovery
  uses. Entries that top-k leaves out stay in the next difference, so compression error
  never accumulates: an entry is at most as stale as its last selection;
- optimizer state: every tensor as ``new - base``, dense and uncompressed (the paper's
  Naïve DC compresses only the model); ``compress_optimizer=True`` top-k compresses these too
  (the paper's "Naïve DC w/ OC", Exp. 5). Tensors that are new (lazily created state),
  not floating point, or changed shape, and non-tensor values, are stored whole;
- whole: buffers and other non-parameter model state, the optimizer's param groups,
  scheduler state, RNG states and the step.

Call sequence (all on the training process unless noted):

0) ``resume()`` restores the newest recoverable state (below) and makes it the base, or
   writes the step-0 full checkpoint of a new directory.
1) (every checkpoint) the state is packed into a shared-memory slot: for a full
   checkpoint a copy of the whole state, for a differential the compressed model
   differences, the optimizer differences and the small state; the base copy is moved
   on; a message naming the slot (:class:`~lowdiff_lab.baselines.naive_dc_writer.NdcFull` or
   :class:`~lowdiff_lab.baselines.naive_dc_writer.NdcDiff`) goes to the checkpointing process.
   ``step()`` blocks only for this (and, under backpressure, for a free slot).
2) (checkpointing process, spawned like lowdiff's own, outside the trainer's process
   group) copies the record out of its slot, frees the slot, ``torch.save``-s it
   atomically with a commit file, and after a full checkpoint applies retention. Its
   errors come back to the trainer and are raised on the next call.
3) ``flush()`` / ``close()`` wait until everything handed off is on disk. A trainer
   that dies (SIGKILL included) leaves a process that writes every record it was handed,
   then exits; the next ``resume()`` waits for it.

Files::

    DIR/lowdiff.json                         manifest (strategy, options)
    DIR/full/ckpt-{step:012d}.pt[.commit]    full checkpoints (torch.save of the state)
    DIR/diffs/diff-{step:012d}.pt[.commit]   differentials, each naming its base_step

Retention keeps the newest ``keep_full`` full checkpoints and deletes the differentials
older than the oldest kept one.

Recovery: the newest intact full checkpoint, then the differentials after it in order,
each applied to the state rebuilt so far (``add`` / top-k scatter-add / replace). The
chain stops, with a :class:`lowdiff.RecoveryWarning` naming the file, at the first
differential that is damaged or does not continue the state rebuilt so far (its base
checkpoint is missing); what lies past the recovered step is moved to
``DIR/quarantine/``. The result is exactly the trainer's base copy at that step, and by
design *not* the exact training state: model parameters carry the top-k error
(bounded by how far each entry moved since it was last selected), optimizer state the
rounding of ``(new - base) + base``. :func:`recovery_error` measures both. Step,
buffers, scheduler and RNG states are restored exactly.

Parts: records, their slots and their arithmetic are
:mod:`~lowdiff_lab.baselines.naive_dc_record`; the base copy and the differences
:mod:`~lowdiff_lab.baselines.naive_dc_diff`; the checkpointing process and its messages
:mod:`~lowdiff_lab.baselines.naive_dc_writer`, the trainer's end of it
:mod:`~lowdiff_lab.baselines.naive_dc_handoff`; recovery
:mod:`~lowdiff_lab.baselines.naive_dc_recovery`.
"""

from __future__ import annotations

import numbers
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from lowdiff.format import layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.options import check_int
from lowdiff.proc.locks import wait_for_writer
from lowdiff.strategy import StepGrads
from lowdiff_lab.baselines.base import BaselineCheckpointer
from lowdiff_lab.baselines.naive_dc_diff import BaseCopy
from lowdiff_lab.baselines.naive_dc_handoff import Handoff
from lowdiff_lab.baselines.naive_dc_record import DIFF_DIR, Packer
from lowdiff_lab.baselines.naive_dc_recovery import ChainRecovery, recovery_error
from lowdiff_lab.baselines.naive_dc_writer import NdcDiff, NdcFull
from lowdiff_lab.baselines.training_state import restore_state

__all__ = ["NaiveDCCheckpointer", "NaiveDCOptions", "recovery_error"]


@dataclass(frozen=True)
class NaiveDCOptions:
    """Naive DC's own options, checked before the directory is locked.

    Raises:
        TypeError, ValueError: naming the option and its value.
    """

    diff_every: int = 1
    """A differential checkpoint every this many steps between full ones."""
    ratio: float = 0.01
    """Top-k ratio of the model-parameter differences, in (0, 1]."""
    compress_optimizer: bool = False
    """Top-k compress the optimizer differences too ("w/ OC")."""
    max_inflight: int = 2
    """Differentials handed off but not yet taken by the checkpointing process."""

    def __post_init__(self) -> None:
        check_int("diff_every", self.diff_every, 1)
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
            raise TypeError(f"ratio must be a real number, got {type(ratio).__name__} {ratio!r}")
        if not 0.0 < float(ratio) <= 1.0:  # written so that NaN fails too
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        object.__setattr__(self, "ratio", float(ratio))
        if not isinstance(self.compress_optimizer, bool):
            raise TypeError(
                f"compress_optimizer must be a bool, got {type(self.compress_optimizer).__name__} "
                f"{self.compress_optimizer!r}"
            )
        check_int("max_inflight", self.max_inflight, 1)


class NaiveDCCheckpointer(BaselineCheckpointer):
    """The LowDiff paper's Naïve DC: differences computed on the training side (module docstring).

    Args:
        diff_every, ratio, compress_optimizer, max_inflight: see :class:`NaiveDCOptions`
            (``max_inflight`` is the depth of the shared-memory slot pool: ``step()``
            waits beyond it).
        common: the options every baseline takes (``compressor``, ``full_every``,
            ``scheduler``, ``keep_full``, ``start_timeout``), as for
            :class:`lowdiff_lab.baselines.BaselineCheckpointer`.

    ``stats`` adds ``fulls``, ``diffs``, ``compress_s`` (training-side time spent
    computing, compressing and packing differences, summed over ``diffs``),
    ``handoff_wait_s`` (time waiting for a free slot), ``diff_bytes`` / ``full_bytes``
    and ``diff_write_s`` / ``full_write_s`` (files written by the checkpointing process);
    ``checkpoints`` counts both kinds.

    Example:
        >>> ck = lowdiff.Checkpointer("ckpt", model, opt, method="naive-dc",
        ...                           full_every=100, ratio=0.01)  # doctest: +SKIP
        >>> start = ck.resume()  # doctest: +SKIP
    """

    strategy = "naive-dc"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        diff_every: int = 1,
        ratio: float = 0.01,
        compress_optimizer: bool = False,
        max_inflight: int = 2,
        **common: Any,
    ) -> None:
        # checked before the base class takes the directory lock
        options = NaiveDCOptions(diff_every, ratio, compress_optimizer, max_inflight)
        self.diff_every, self.ratio = options.diff_every, options.ratio
        self.compress_optimizer, self.max_inflight = compress_optimizer, max_inflight
        super().__init__(model, optimizer, directory, **common)
        self._base = BaseCopy(
            model, optimizer, self.scheduler, self._rng_layout, self.ratio, compress_optimizer
        )
        self._stats.update(
            fulls=0,
            diffs=0,
            compress_s=0.0,
            handoff_wait_s=0.0,
            diff_bytes=0,
            full_bytes=0,
            diff_write_s=0.0,
            full_write_s=0.0,
        )
        self._handoff = Handoff(
            self.root, self.keep_full, self.start_timeout, max_inflight, self._stats
        )

    @property
    def _base_params(self) -> dict[str, torch.Tensor]:
        """The base copy of the floating-point parameters (flat, by name): exactly what a
        recovery at the last checkpoint rebuilds."""
        return self._base.params

    # ------------------------------------------------------------------ the step loop
    def after_update(self, t: int, grads: StepGrads, hp: Any, update_s: float) -> None:
        """A full checkpoint when due (the base class), else a differential one when due."""
        super().after_update(t, grads, hp, update_s)
        s = self._step
        if s % self.full_every != 0 and s % self.diff_every == 0:
            t0 = time.perf_counter()
            self._diff(s)
            self._stats["checkpoints"] += 1
            self._stats["stall_s"] += time.perf_counter() - t0

    def _manifest_extra(self) -> dict[str, Any]:
        return {
            "diff_every": self.diff_every,
            "ratio": self.ratio,
            "compress_optimizer": self.compress_optimizer,
        }

    def _checkpoint(self, step: int) -> None:
        """Full checkpoint: the whole state into the full slot; it becomes the base."""
        self._handoff.ensure_ready()
        pk = Packer()
        spec = pk.walk(self._capture(step))
        slot, buf = self._handoff.acquire(NdcFull.pool, pk.nbytes)
        pk.fill(buf)
        self._base.rebase_full(spec, buf)
        self._handoff.send(NdcFull(self._handoff.generation(NdcFull.pool), slot, step, spec))
        self._base.step = step
        self._stats["fulls"] += 1

    def _diff(self, step: int) -> None:
        """Differential checkpoint: compute and compress the differences, hand them off."""
        self._handoff.ensure_ready()
        t0 = time.perf_counter()
        pk = Packer()
        plan = self._base.plan(step, pk)
        computed = time.perf_counter() - t0
        slot, buf = self._handoff.acquire(NdcDiff.pool, pk.nbytes)
        t1 = time.perf_counter()
        pk.fill(buf)
        self._base.apply(plan, buf)
        self._handoff.send(NdcDiff(self._handoff.generation(NdcDiff.pool), slot, step, plan.record))
        self._base.step = step
        self._stats["diffs"] += 1
        self._stats["compress_s"] += computed + time.perf_counter() - t1

    # ------------------------------------------------------------------ checkpointing process
    def _after_resume(self) -> None:
        # started here and awaited at the first hand-off, so that its start-up (importing
        # torch) overlaps whatever the trainer does before its first checkpoint
        self._handoff.start()

    def _poll(self) -> None:
        self._handoff.link.poll()
        self._durable = max(self._durable, self._handoff.durable)

    def _raise_background_error(self) -> None:
        self._poll()
        self._handoff.link.check()

    def _flush(self) -> None:
        self._handoff.flush()
        self._durable = max(self._durable, self._handoff.durable)

    def _shutdown(self) -> None:
        self._handoff.shutdown(closing=self._closed)

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> int | None:
        wait_for_writer(self.root, self.start_timeout)
        for d in (self.root / layout.FULL_DIR, self.root / DIFF_DIR):
            remove_stale_temps(d)
        t_start = time.perf_counter()
        rebuilt = ChainRecovery(self.root).run(self._base.aliases)
        if rebuilt is None:
            return None
        state, step, stats = rebuilt
        t0 = time.perf_counter()
        self._base.rebase_recovered(state, step)
        restore_state(state, self.model, self.optimizer, self.scheduler, where=f"step {step}")
        stats.replay_s += time.perf_counter() - t0
        stats.total_s = time.perf_counter() - t_start
        self.recovery_stats = stats
        return step
