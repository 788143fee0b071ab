"""lowdiff for Lightning (``lightning.Trainer`` or ``pytorch_lightning.Trainer``): one callback.

Example::

    from lowdiff.integrations.lightning import LowDiffCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[LowDiffCallback("runs/ckpt", compressor=lowdiff.TopK(0.01))])
    trainer.fit(module, train_dataloaders=StatefulDataLoader(...))   # resumes by itself

How it fits Lightning:

- ``on_fit_start`` (the strategy has set up the model and created the optimizer and LR
  schedulers): ``lowdiff.attach`` on the ``torch.optim`` optimizer under Lightning's
  wrapper, with the first LR scheduler, then ``resume()``. Lightning calls
  ``optimizer.step(closure)``: the closure (forward and backward) runs first, lowdiff
  takes the gradients after it.
- The fit loop's state (``trainer.fit_loop.state_dict()``: epoch, batch and optimizer-step
  progress, hence ``global_step``, and the state of a stateful train data loader such as
  torchdata's ``StatefulDataLoader``) is ``extra_state``. It is taken in
  ``on_train_batch_end`` (``on_train_epoch_end`` for the epoch's last batch), where
  Lightning's own ``ModelCheckpoint`` takes it, once the step and the step-wise LR
  schedulers are done, and saved with that step. The epoch's last step also saves the
  RNG states as they are then: after the epoch's validation, which draws random numbers
  and which a resume at that step does not run again.
- Resuming needs nothing from the user: ``on_fit_start`` runs before Lightning restores
  its loops, and ``resume()`` hands the saved fit-loop state to ``fit_loop.load_state_dict``
  exactly as Lightning does with its own checkpoints (``ckpt_path=``), so the fit loop
  goes on from the next batch of the same epoch. Do not pass ``ckpt_path`` as well. Where
  Lightning's own restore would not resume exactly, the callback steps in: resumed at an
  epoch's end without ``max_steps``, the saved loader states are loaded all the same
  (Lightning skips them there), and at the end of an epoch resumed inside, a
  ``ReduceLROnPlateau`` with interval ``"epoch"`` is stepped when its monitored value was
  logged since the resume (Lightning skips that step after any restore).
- ``ck.stats`` is logged through the LightningModule's loggers every
  ``log_every_n_steps`` (``lowdiff/...``).
- ``on_fit_end`` closes the checkpointer (everything durable); so does an exception
  (``on_exception``), except on a rank of a distributed LowDiff+ job: there the callback
  lets go of the checkpointer as a rank that dies does, and its replica stays in memory
  for the restarted rank (see below).

Single optimizer, automatic optimization. Under DDP (``strategy="ddp"``) every rank runs
the callback: lowdiff is given Lightning's ``DistributedDataParallel`` model and installs
its own communication hook on it before the first backward (Lightning's
``DDPStrategy(ddp_comm_hook=...)`` must stay unset: a DDP model takes one hook). For an
exact mid-epoch resume under DDP, give the loader torch's ``RandomSampler`` (or
``SequentialSampler``): Lightning replaces it with a ``DistributedSampler``, whose order
follows from its seed and the epoch, and the callback sets the restored epoch before the
loader fast-forwards (Lightning would set it only afterwards). Other samplers are
wrapped in Lightning's ``DistributedSamplerWrapper``, whose order depends on how often it
was iterated.

FSDP2: with ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` and
``fully_shard`` applied in the module's ``configure_model`` (a 1-D mesh,
``self.device_mesh["data_parallel"]``), Lightning's model is the ``fully_shard``ed
module, and ``strategy="lowdiff+"`` checkpoints each rank's own shard (CPU ranks with
gloo run it; see ``examples/lightning_train.py --fsdp2``).

When a rank of a LowDiff+ job (DDP or FSDP2) dies, the others fail on the collective its
death broke (or on the launcher's SIGTERM, which Lightning raises as an exception), and
Lightning calls ``on_exception`` on them; a rank whose own training raises gets the same
call. These callbacks do not close: each
lets go of its checkpointer as a rank that dies does, so every replica merges the steps
it was handed, persists them, and waits in memory (``Timeouts(idle=...)``) for the
restarted job. That job resumes from the replicas when all of them hold the same
step (``ck.recovery_stats.source == "memory"``). A step is handed over when the next
``optimizer.step`` begins: a rank that dies in update S before its gradients were
exchanged leaves every replica at step S - 1; one that dies after the exchange, and
before update S + 1 begins (in Lightning's hooks after the update, or loading the next
batch), leaves the others to hand over step S, and the job resumes from disk, at the
newest step every rank persisted (up to ``ReplicaOptions.persist_every`` steps back,
``full_every`` by default under DDP). On one process, and under LowDiff, an exception
closes the checkpointer.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import torch

from lowdiff.attach import attach, own_strategy
from lowdiff.checkpointer import Checkpointer, Method
from lowdiff.compressors.base import Compressor
from lowdiff.errors import LowDiffError
from lowdiff.integrations._common import (
    CALLBACK_OPTIONS,
    callback_extra_state,
    rng_state,
    set_rng_state,
    stats_for_logging,
    unwrap_optimizer,
)
from lowdiff.legacy import accepts_old_spellings
from lowdiff.options import RemoteOptions, ReplicaOptions, Timeouts

try:  # the unified package, else the standalone one
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]

log = logging.getLogger("lowdiff.integrations.lightning")

FIT_LOOP = "lightning_fit_loop"
"""The ``extra_state`` name under which the fit loop's state is saved."""

_RNG = "lowdiff_rng"
"""The key of the RNG states in the saved fit-loop state (an epoch's last step)."""


class _FitLoopState:
    """Lightning's fit loop (progress counters, stateful data loader) as ``extra_state``,
    and the RNG states taken with it at an epoch's end."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.rng: dict[str, Any] | None = None
        """RNG states saved with the fit loop's state: set while the epoch's last step
        takes it (after the epoch's validation, which draws random numbers), else None."""

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = self.trainer.fit_loop.state_dict()
        if self.rng is not None:
            sd[_RNG] = self.rng
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # what Lightning's checkpoint connector does with checkpoint["loops"]["fit_loop"]
        sd = dict(sd)
        self.rng = sd.pop(_RNG, None)
        loop = self.trainer.fit_loop
        loop.load_state_dict(sd)
        _load_loader_states(loop)


def _load_loader_states(loop: Any) -> None:
    """Have the fit loop's next ``_load_combined_loader_states`` (in ``setup_data``) give
    the train samplers the restored epoch first, and load the saved loader states even
    where Lightning would not.

    - The epoch first: Lightning's fit loop loads the saved data loader states and
      creates the iterator (a ``StatefulDataLoader`` then fast-forwards its sampler to the
      saved position) before it calls ``set_epoch`` on the samplers
      (``on_advance_start``). A sampler whose order depends on the epoch, such as the
      ``DistributedSampler`` that Lightning puts in under DDP, would then be
      fast-forwarded through epoch 0's order, and a run resumed mid-epoch would see other
      batches than an uninterrupted one.
    - Always loaded: the state of an epoch's last step (taken in ``on_train_epoch_end``)
      counts the epoch as processed, and without ``max_steps`` Lightning then takes the
      loop as not restarting and skips the saved loader states. The next epoch would
      start from a fresh loader, and a sampler whose order depends on how often it was
      iterated (torchdata's ``RandomSampler`` with its own generator) would replay the
      first epoch's order.
    """
    original = getattr(loop, "_load_combined_loader_states", None)
    if original is None:  # not the fit loop this was written against: leave it alone
        return
    from lightning.fabric.utilities.data import _set_sampler_epoch

    def set_epoch_then_load_states() -> None:
        del loop._load_combined_loader_states  # back to the class's method
        combined = getattr(loop, "_combined_loader", None)
        if combined is not None:
            for dl in combined.flattened:
                _set_sampler_epoch(dl, loop.epoch_progress.current.processed)
        states = getattr(loop, "_combined_loader_states_to_load", None)
        if combined is None or not states or loop.restarting:
            original()
            return
        # the saved epoch is over and the loop goes on with the next one, on a new iterator
        # of each loader (as in the run that stopped): each loader's iterator as saved is
        # created first, so that its sampler moves past the saved epoch (torchdata's
        # RandomSampler draws that epoch's order from its generator again)
        combined._load_state_dicts(states)
        loop._combined_loader_states_to_load = []
        with torch.random.fork_rng(devices=[]):  # a loader without a generator draws one
            for dl in combined.flattened:
                if callable(getattr(dl, "load_state_dict", None)):
                    iter(dl)

    loop._load_combined_loader_states = set_epoch_then_load_states


class LowDiffCallback(pl.Callback):
    """Checkpoint every optimizer step of a Lightning ``Trainer`` with lowdiff.

    Args:
        directory: the lowdiff checkpoint directory (under DDP: the job's directory; each
            rank writes its shard below it).
        extra_state: more state to save with every step (``{"name": obj}``, see
            :class:`lowdiff.Checkpointer`); the name ``"lightning_fit_loop"`` is taken.
        log_stats: log ``ck.stats`` through the LightningModule's loggers.

    The other keyword options (``method``, ``compressor``, ``full_every``,
    ``records_per_file``, ``keep_full``, ``max_inflight``, ``on_storage_error``, ``mtbf``,
    ``replica``, ``remote``, ``timeouts``) are those of :class:`lowdiff.Checkpointer`;
    the Trainer's own LR scheduler is the one checkpointed.

    Example:
        >>> cb = LowDiffCallback("runs/ckpt", compressor=lowdiff.TopK(0.01))  # doctest: +SKIP
        >>> trainer = L.Trainer(max_steps=1000, callbacks=[cb])  # doctest: +SKIP
        >>> trainer.fit(module, train_dataloaders=loader)  # doctest: +SKIP

    With a ``StatefulDataLoader`` (torchdata) as the train loader, a resumed run sees
    exactly the batches an uninterrupted one would; with ``error_feedback=False`` (or
    ``strategy="lowdiff+"``) training after a resume is bit-identical.
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
        extra_state = callback_extra_state(extra_state, FIT_LOOP, "the fit loop")
        self.directory = directory
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
        """The checkpointer, from ``on_fit_start`` on."""
        self.resumed_step: int | None = None
        """The optimizer step ``resume()`` returned."""
        self._fit_state: _FitLoopState | None = None
        self._trained = False
        """Whether a training batch ended since ``on_fit_start``."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None:
            raise LowDiffError(
                "LowDiffCallback resumes from its own directory: do not pass ckpt_path to fit()"
            )
        if len(trainer.optimizers) != 1 or not pl_module.automatic_optimization:
            raise LowDiffError(
                "LowDiffCallback supports one optimizer with automatic optimization "
                f"(got {len(trainer.optimizers)} optimizers, automatic_optimization="
                f"{pl_module.automatic_optimization})"
            )
        configs = trainer.lr_scheduler_configs
        if len(configs) > 1:
            raise LowDiffError(
                f"LowDiffCallback supports at most one LR scheduler, got {len(configs)}"
            )
        scheduler = configs[0].scheduler if configs else None
        model = trainer.strategy.model  # DistributedDataParallel under DDP, else the module
        assert isinstance(model, torch.nn.Module)
        if self.ck is not None:
            self.ck.close()
        fit_state = _FitLoopState(trainer)
        ck = attach(
            self.directory,
            model,
            unwrap_optimizer(trainer.optimizers[0]),
            scheduler=scheduler,
            extra_state={FIT_LOOP: fit_state, **self.extra_state},
            **self.options,
        )
        ck.capture_after_update(FIT_LOOP)
        self.ck, self._fit_state, self._trained = ck, fit_state, False
        self.resumed_step = ck.resume()  # restores the fit loop through load_state_dict
        if self.resumed_step:
            if fit_state.rng is not None:
                # at an epoch's end: the RNG states after the epoch's validation, which the
                # run that stopped went on with (lowdiff restored those of the update)
                set_rng_state(fit_state.rng)
                fit_state.rng = None
            log.info(
                "lowdiff: resumed at optimizer step %d (epoch %d)",
                self.resumed_step,
                trainer.current_epoch,
            )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._trained = True
        if self.ck is None:
            return
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self.ck.recapture(FIT_LOOP)
        # else on_train_epoch_end takes it: taken here, the epoch's last step would resume
        # into the next epoch with the epoch counter one ahead
        if (
            self.log_stats
            and trainer.global_step % max(int(getattr(trainer, "log_every_n_steps", 50)), 1) == 0
        ):
            stats = stats_for_logging(self.ck)
            for logger in trainer.loggers:
                logger.log_metrics(stats, step=trainer.global_step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ck is None or self._fit_state is None:
            return
        if trainer.fit_loop.restarting and self._trained:
            _plateau_steps_after_resume(trainer)
        # the epoch's last step: the fit loop's state at the end of the epoch, where
        # Lightning's own end-of-epoch checkpoints take it, with the RNG states after the
        # epoch's validation (a resume at this step does not run it again)
        self._fit_state.rng = rng_state()
        self.ck.recapture(FIT_LOOP)
        self._fit_state.rng = None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning calls this on every failure of fit() on this rank: an exception in
        # training, a collective that failed because another rank died, its SIGTERM
        # (raised as SIGTERMException), Ctrl+C; it tears the strategy down afterwards
        if self.ck is not None and _keeps_replica_of_job(self.ck):
            _leave_replica(self.ck)
        else:
            self._close()

    def _close(self) -> None:
        if self.ck is not None:
            self.ck.close()


def _keeps_replica_of_job(ck: Checkpointer) -> bool:
    """Whether ``ck`` is a rank of a distributed job (DDP or ``fully_shard``) whose
    checkpointing process is LowDiff+'s replica."""
    impl = own_strategy(ck)  # attach() builds only lowdiff's own methods
    backend = impl.backend
    return impl.objects.dist is not None and backend is not None and backend.keeps_replica


def _leave_replica(ck: Checkpointer) -> None:
    """Let go of ``ck`` after a failure as a rank of a distributed job that dies lets go
    (:meth:`lowdiff.engine.trainer.strategy.EngineStrategy.let_go`): its replica merges
    every step it received, persists, publishes itself orphaned and waits for the
    restarted rank to take it over. ``ck`` counts as closed from here on."""
    own_strategy(ck).let_go()


def _plateau_steps_after_resume(trainer: pl.Trainer) -> None:
    """At the end of the epoch a run resumed inside: let Lightning step a
    ``ReduceLROnPlateau`` with interval ``"epoch"``, as the run that stopped did.

    After any restore of its loops Lightning skips that step at the end of the resumed
    epoch (the fit loop is still restarting), because the monitored metric is not saved
    in a checkpoint. A value logged since the resume is the run's own: a validation
    metric (the validation at the epoch's end ran after the resume point) or a value
    logged per step is the stopped run's, bit for bit. The fit loop is then told it is not
    restarting any more (it would be, right after this epoch). Without the value the step
    stays skipped, as Lightning does, with a warning.
    """
    configs = [
        c for c in trainer.lr_scheduler_configs if c.reduce_on_plateau and c.interval == "epoch"
    ]
    if not configs:
        return
    missing = [c.monitor for c in configs if c.monitor not in trainer.callback_metrics]
    if missing:
        log.warning(
            "lowdiff: ReduceLROnPlateau is not stepped at the end of the epoch the run resumed "
            "in: %s was not logged since the resume (training goes on as after a restore "
            "by Lightning itself, but not as the run that stopped)",
            ", ".join(map(repr, missing)),
        )
        return
    loop = trainer.fit_loop
    if hasattr(loop, "_restarting"):
        loop._restarting = False
