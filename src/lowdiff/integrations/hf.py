"""lowdiff for Hugging Face ``transformers.Trainer``: one callback.

Example::

    from lowdiff.integrations.hf import LowDiffCallback

    cb = LowDiffCallback("runs/ckpt", compressor=lowdiff.TopK(0.01, error_feedback=False))
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_from_checkpoint)   # None on a fresh start

How it fits the Trainer:

- ``on_train_begin`` (the Trainer has created, and Accelerate prepared, the optimizer and
  the LR scheduler): ``lowdiff.attach`` on the ``torch.optim`` optimizer under
  Accelerate's wrapper, with the scheduler, then ``resume()``. Every
  ``optimizer.step()`` of the Trainer is checkpointed from then on.
- The Trainer's progress (``TrainerState``: global step, epoch, FLOs, tokens seen, best
  metric) is ``extra_state``; it is taken at ``on_step_end``, once the Trainer has counted
  the step, and saved with that step. Under ``attach`` a step is handed to the
  checkpointing process only when the next update begins, so what the Trainer does after
  ``on_step_end`` still belongs to the step: the ``TrainerState`` is taken again at
  ``on_evaluate``, ``on_save``, ``on_epoch_begin``, ``on_train_end`` and the next
  ``on_step_begin`` (the best metric is set after an evaluation, the FLOs at a log). An
  evaluation also draws random numbers (creating its data loader's iterator does), so a
  step the Trainer evaluated, saved or ended an epoch at is saved with the RNG states
  taken after that (at ``on_evaluate``, ``on_save``, ``on_epoch_begin``,
  ``on_train_end``), which a resume at that step applies; other steps carry none.
- Resuming: :attr:`LowDiffCallback.resume_from_checkpoint` reads the newest recoverable
  step and its ``TrainerState`` from the checkpoint files' headers and writes a small
  Trainer checkpoint directory (``trainer_state.json`` and the model's current weights,
  which the Trainer requires) for ``trainer.train(resume_from_checkpoint=...)``. The
  Trainer then skips the batches already trained with its own mechanism (same epochs,
  same shuffling seed), and ``on_train_begin`` restores the model, optimizer, scheduler and
  RNG states exactly from lowdiff (then the RNG states saved after the step's
  evaluation, if it had one). Resumed mid-epoch, the RNG states are set again right before
  the first new step (the Trainer's skipping draws random numbers, as it does for its own
  checkpoints).
- ``on_log`` adds ``ck.stats`` (``lowdiff/...``) to the Trainer's log entry.
- ``on_train_end`` closes the checkpointer (everything durable).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lowdiff.attach import attach
from lowdiff.checkpointer import Checkpointer, Method
from lowdiff.compressors.base import Compressor
from lowdiff.errors import LowDiffError, UsageError
from lowdiff.integrations._common import (
    CALLBACK_OPTIONS,
    callback_extra_state,
    not_single_process,
    rng_state,
    saved_extra,
    set_rng_state,
    stats_for_logging,
    unwrap_optimizer,
    unwrap_scheduler,
)
from lowdiff.legacy import accepts_old_spellings
from lowdiff.options import RemoteOptions, ReplicaOptions, Timeouts
from lowdiff.proc.holder import wait_until_written

log = logging.getLogger("lowdiff.integrations.hf")

TRAINER_STATE = "hf_trainer"
"""The ``extra_state`` name under which the Trainer's progress is saved."""

_FIELDS = (
    "global_step",
    "epoch",
    "total_flos",
    "num_input_tokens_seen",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)
"""The ``TrainerState`` fields saved with every step (``log_history`` is not: it grows
with the run, and every record would carry all of it)."""


class _TrainerProgress:
    """The Trainer's ``TrainerState`` counters as an ``extra_state`` object, and the RNG
    states after the Trainer's work that followed the step (an evaluation), if it had any."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state
        self.rng: dict[str, Any] | None = None
        """RNG states taken after the step's evaluation, save or epoch end; None for the
        other steps (their records stay small: lowdiff's own RNG states, taken at the
        update, are theirs)."""

    def state_dict(self) -> dict[str, Any]:
        sd = {k: getattr(self.state, k) for k in _FIELDS}
        sd["rng"] = self.rng
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k in _FIELDS:
            if k in sd:
                setattr(self.state, k, sd[k])
        self.rng = sd.get("rng")


class LowDiffCallback(TrainerCallback):
    """Checkpoint every optimizer step of a ``transformers.Trainer`` with lowdiff.

    Args:
        directory: the lowdiff checkpoint directory.
        extra_state: more state to save with every step (``{"name": obj}``, see
            :class:`lowdiff.Checkpointer`); the name ``"hf_trainer"`` is taken.
        log_stats: add ``ck.stats`` to the Trainer's logs (``on_log``).

    The other keyword options (``method``, ``compressor``, ``full_every``,
    ``records_per_file``, ``keep_full``, ``max_inflight``, ``on_storage_error``, ``mtbf``,
    ``replica``, ``remote``, ``timeouts``) are those of :class:`lowdiff.Checkpointer`;
    the Trainer's own LR scheduler is the one checkpointed.

    Example:
        >>> cb = LowDiffCallback("runs/ckpt", compressor=lowdiff.TopK(0.01))  # doctest: +SKIP
        >>> trainer = Trainer(model=m, args=args, train_dataset=ds, callbacks=[cb])  # doctest: +SKIP
        >>> trainer.train(resume_from_checkpoint=cb.resume_from_checkpoint)  # doctest: +SKIP

    Single process only (the Trainer under ``torchrun`` is refused with a clear error).
    ``args.ignore_data_skip`` must stay False (the Trainer skips the trained batches;
    True is refused). After a resume, other callbacks' exported state (an
    ``EarlyStoppingCallback``'s patience) starts fresh, and ``TrainerState.total_flos`` is
    the Trainer's count as of its last log or save up to the resume point (the Trainer
    adds a step's FLOs to it only when it logs or saves).
    With ``error_feedback=False`` (or no compression, ``strategy="lowdiff+"``) training
    after a resume is bit-identical to a run that never stopped, also at a step where the
    Trainer evaluated or saved: such a step is saved with the ``TrainerState`` (best
    metric) and RNG states as they were after the evaluation. A data collator that draws
    random numbers is not covered: the Trainer fetches the next step's batches before
    ``on_step_begin``, and a resumed run fetches them from other RNG states.
    """

    @accepts_old_spellings("LowDiffCallback", CALLBACK_OPTIONS)
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        extra_state: dict[str, Any] | None = None,
        log_stats: bool = True,
        method: Method | str = "auto",
        compressor: Compressor | None = None,
        full_every: int | Literal["auto"] = 30,
        records_per_file: int | Literal["auto"] = 3,
        keep_full: int | None = 2,
        max_inflight: int | None = None,
        on_storage_error: Literal["raise", "warn"] = "raise",
        mtbf: float | None = None,
        replica: ReplicaOptions | None = None,
        remote: RemoteOptions | str | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        extra_state = callback_extra_state(extra_state, TRAINER_STATE, "the Trainer's state")
        self.directory = Path(directory)
        self.extra_state = extra_state
        self.log_stats = log_stats
        self.options: dict[str, Any] = dict(
            method=method, compressor=compressor, full_every=full_every,
            records_per_file=records_per_file, keep_full=keep_full, max_inflight=max_inflight,
            on_storage_error=on_storage_error, mtbf=mtbf, replica=replica, remote=remote,
            timeouts=timeouts,
        )  # fmt: skip
        """The options :func:`lowdiff.attach` is called with."""
        self.ck: Checkpointer | None = None
        """The checkpointer, from ``on_train_begin`` on."""
        self._args: TrainingArguments | None = None
        self._model: torch.nn.Module | None = None
        self._resume_dir: Path | None = None
        self._resume_step: int | None = None
        self._progress: _TrainerProgress | None = None
        self._rng_at_resume: dict[str, Any] | None = None

    # ------------------------------------------------------------------ resuming
    @property
    def resume_from_checkpoint(self) -> str | None:
        """A Trainer checkpoint directory to pass to ``trainer.train(resume_from_checkpoint=)``
        (None when ``directory`` holds no checkpoint yet).

        It holds ``trainer_state.json`` of the newest recoverable step (so the Trainer
        skips the batches already trained) and the model's current weights (the Trainer
        insists on a weights file; lowdiff overwrites them in ``on_train_begin``). It lies in
        ``args.output_dir/lowdiff-resume`` and is rewritten at every call.
        """
        if self._args is None or self._model is None:
            raise UsageError(
                "resume_from_checkpoint is known once the callback is given to a Trainer "
                "(Trainer(..., callbacks=[cb]))"
            )
        if not self.directory.exists():
            return None
        # a killed trainer's checkpointing process may still be writing its last records
        # (then it waits for the next trainer, which takes it over)
        wait_until_written(self.directory, (self.options["timeouts"] or Timeouts()).start)
        found = saved_extra(self.directory)
        if found is None:
            return None
        step, extra = found
        progress = extra.get(TRAINER_STATE)
        if progress is None:
            raise LowDiffError(
                f"{self.directory} holds no Trainer state at step {step}: it was not written "
                "by lowdiff.integrations.hf.LowDiffCallback"
            )
        out = Path(self._args.output_dir or ".") / "lowdiff-resume"
        out.mkdir(parents=True, exist_ok=True)
        state = TrainerState(train_batch_size=self._args.per_device_train_batch_size)
        # the values the Trainer compares with its arguments (a mismatch only warns)
        for k in ("logging_steps", "eval_steps", "save_steps"):
            setattr(state, k, getattr(self._args, k))
        _TrainerProgress(state).load_state_dict(progress)
        state.save_to_json(str(out / "trainer_state.json"))
        self._save_weights(out)
        self._resume_dir, self._resume_step = out, step
        log.info("lowdiff: resume point at step %d (global step %d)", step, state.global_step)
        return str(out)

    def _save_weights(self, out: Path) -> None:
        """The weights the Trainer insists on loading from a resume point (lowdiff restores
        the model itself afterwards). Every key is written, tied weights too: the Trainer
        loads the file non-strictly and warns about each key it lacks, and
        ``save_pretrained`` leaves tied weights out."""
        import safetensors.torch

        assert self._model is not None
        save = getattr(self._model, "save_pretrained", None)
        if callable(save):
            save(str(out), safe_serialization=True)  # config.json and the rest beside it
        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, t in self._model.state_dict().items():
            t = t.detach()
            key = t.untyped_storage().data_ptr()
            # safetensors refuses tensors that share memory: a tied weight gets its own copy
            tensors[name] = t.clone() if key in seen else t.contiguous()
            seen.add(key)
        safetensors.torch.save_file(
            tensors, str(out / "model.safetensors"), metadata={"format": "pt"}
        )

    # ------------------------------------------------------------------ Trainer events
    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self._args, self._model = args, model

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        _refuse_setup(args)
        if model is None or optimizer is None:
            raise LowDiffError("on_train_begin: the Trainer passed no model or optimizer")
        if self.ck is not None:
            self.ck.close()
        hf_state_step = state.global_step  # from the resume point's trainer_state.json, else 0
        progress = _TrainerProgress(state)
        ck = attach(
            self.directory,
            model,
            unwrap_optimizer(optimizer),
            scheduler=unwrap_scheduler(lr_scheduler),
            extra_state={TRAINER_STATE: progress, **self.extra_state},
            **self.options,
        )
        ck.capture_after_update(TRAINER_STATE)
        self.ck, self._progress = ck, progress
        start = ck.resume()  # restores TrainerState through progress.load_state_dict
        if start == 0:
            progress.rng = None
            return
        self._check_resume_point(start, hf_state_step, state.global_step)
        # the resume point's trainer_state.json holds no callback states: the Trainer's
        # next checkpoint of its own looks each of its stateful callbacks up there
        # (typed as a list of callbacks, a dict of their states once built or loaded)
        states: Any = state.stateful_callbacks or {}
        state.stateful_callbacks = _CallbackStates(states)  # type: ignore[assignment]
        # the RNG states after the step's evaluation (or epoch end), where the run that
        # stopped went on from; lowdiff restored those of the step's update
        if progress.rng is not None:
            set_rng_state(progress.rng)
            progress.rng = None
        if _mid_epoch(args, state, train_dataloader):
            self._rng_at_resume = rng_state()
        log.info("lowdiff: resumed at optimizer step %d, global step %d", start, state.global_step)

    def _check_resume_point(self, start: int, hf_state_step: int, global_step: int) -> None:
        """Close the checkpointer and raise unless the Trainer resumed from this callback's
        resume point (``hf_state_step``: its global step before ``resume()``) and lowdiff
        reached the step that point was made for."""
        assert self.ck is not None
        if self._resume_step is None or hf_state_step != global_step:
            self.ck.close()
            self.ck = None
            raise LowDiffError(
                f"{self.directory} resumes at optimizer step {start} (global step "
                f"{global_step}), but the Trainer starts at global step {hf_state_step}: "
                "call trainer.train(resume_from_checkpoint=callback.resume_from_checkpoint)"
            )
        if start != self._resume_step:
            self.ck.close()
            self.ck = None
            raise LowDiffError(
                f"{self.directory}: resume() reached step {start}, the resume point was made for "
                f"step {self._resume_step} (a damaged file?); take resume_from_checkpoint again"
            )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._rng_at_resume is not None:
            # the Trainer's skip of the trained batches drew random numbers that the
            # uninterrupted run drew at the start of the epoch
            set_rng_state(self._rng_at_resume)
            self._rng_at_resume = None
        if self.ck is not None and self._progress is not None:
            # the previous step's last chance: what the Trainer changed since (the FLOs at a
            # log, the best metric after an evaluation), without the RNG states: the Trainer
            # has fetched this step's batches already
            self.ck.retake(TRAINER_STATE)
            self._progress.rng = None  # this step's own record carries none

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.ck is not None:
            self.ck.recapture(TRAINER_STATE)

    def _after_step(self) -> None:
        """The Trainer evaluated, saved or began an epoch after the step waiting for its
        hand-over: take its ``TrainerState`` and the RNG states again."""
        if self.ck is not None and self._progress is not None:
            self._progress.rng = rng_state()
            self.ck.retake(TRAINER_STATE)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._after_step()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._after_step()

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._after_step()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self.log_stats or self.ck is None or logs is None:
            return
        stats = stats_for_logging(self.ck)
        logs.update(stats)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(stats)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._after_step()
        if self.ck is not None:
            self.ck.close()
            log.info("lowdiff: closed at optimizer step %d", self.ck.step_count)


class _CallbackStates(dict):  # type: ignore[type-arg]
    """``TrainerState.stateful_callbacks`` of a run resumed by lowdiff: a callback the
    resume point holds no state for (``TrainerControl``, an early-stopping callback) has
    none (its state starts fresh), instead of a ``KeyError`` when the Trainer saves a
    checkpoint of its own. A plain ``dict`` to ``dataclasses.asdict`` and JSON."""

    def __missing__(self, key: str) -> None:
        return None


def _refuse_setup(args: TrainingArguments) -> None:
    """Raise for training arguments that :meth:`LowDiffCallback.on_train_begin` cannot
    checkpoint: several processes, or batches not skipped at a resume."""
    if args.world_size > 1:
        raise not_single_process("lowdiff.integrations.hf.LowDiffCallback")
    if args.ignore_data_skip:
        raise LowDiffError(
            "LowDiffCallback needs TrainingArguments(ignore_data_skip=False): a resumed "
            "Trainer must skip the batches already trained, or the data order after a "
            "resume differs from the run that stopped"
        )


def _mid_epoch(args: TrainingArguments, state: TrainerState, loader: Any) -> bool:
    """Whether the Trainer resumes inside an epoch (it then skips batches), computed as the
    Trainer does."""
    if args.ignore_data_skip:
        return False
    try:
        n = len(loader)
    except TypeError:
        return state.global_step % max(state.max_steps, 1) != 0
    ga = args.gradient_accumulation_steps
    per_epoch = max(n // ga + int(n % ga > 0), 1)
    return state.global_step % per_epoch != 0
