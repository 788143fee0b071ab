"""``lowdiff.Checkpointer``: per-iteration checkpointing of a training loop.

It checks the arguments, picks the method and hands every call to it. A method
implements :class:`lowdiff.strategy.Strategy`, whose ``step()`` is the one step
pipeline: lowdiff's own (``"lowdiff"``, ``"lowdiff+"``, ``"compression-only"``) and any
registered through :func:`lowdiff.register_method`. ``isinstance(ck,
lowdiff.Checkpointer)`` holds whatever the method.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch

from lowdiff import methods
from lowdiff.compressors.base import Compressor
from lowdiff.errors import ArgumentTypeError, InvalidArgumentError, UsageError
from lowdiff.legacy import accepts_old_spellings, did_you_mean
from lowdiff.options import RemoteOptions, ReplicaOptions, Timeouts
from lowdiff.proc import forkmem
from lowdiff.proc.spawn import refuse_in_bootstrap
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.state import capture as st
from lowdiff.strategy import StepTimings, Strategy

OPTIONS: tuple[str, ...] = (
    "method", "compressor", "scheduler", "extra_state", "full_every", "records_per_file",
    "keep_full", "max_inflight", "on_storage_error", "mtbf", "replica", "remote", "timeouts",
    "method_options",
)  # fmt: skip
"""The keyword options of :class:`Checkpointer` (and of :func:`lowdiff.attach` and the
integrations' callbacks)."""

_DEFAULTS: dict[str, Any] = {
    "records_per_file": 3, "max_inflight": None, "on_storage_error": "raise", "mtbf": None,
    "replica": None, "remote": None, "extra_state": None,
}  # fmt: skip
"""Options of lowdiff's own methods that a registered method does not take: given with
another value, they are refused by name."""

Method = Literal["auto", "lowdiff", "lowdiff+", "compression-only"]


def resolve_method(method: str, compressor: Compressor | None) -> str:
    """The method ``method=`` names: ``"auto"`` is ``"lowdiff"`` with a compressor and
    ``"lowdiff+"`` without one (training's gradients stay as they are)."""
    if not isinstance(method, str):
        raise ArgumentTypeError(f"method must be a str, got {type(method).__name__}")
    if method == "auto":
        return "lowdiff" if compressor is not None else "lowdiff+"
    if method in ("lowdiff", "compression-only") and compressor is None:
        raise InvalidArgumentError(
            f"method {method!r} trains with compressed gradients and needs compressor= "
            "(e.g. lowdiff.TopK(ratio=0.01), which changes what the optimizer applies); "
            "without compression use method='lowdiff+' (the default)"
        )
    return method


def _engine_options(method: str, given: dict[str, Any]) -> dict[str, Any]:
    """The options of lowdiff's own methods as their engine takes them."""
    replica: ReplicaOptions | None = given["replica"]
    if replica is not None and method != "lowdiff+":
        raise InvalidArgumentError(f"replica= applies to method 'lowdiff+', not {method!r}")
    replica = replica or ReplicaOptions()
    timeouts: Timeouts = given["timeouts"] or Timeouts()
    if not isinstance(timeouts, Timeouts):
        raise ArgumentTypeError(f"timeouts must be lowdiff.Timeouts, got {type(timeouts).__name__}")
    if not isinstance(replica, ReplicaOptions):
        raise ArgumentTypeError(
            f"replica must be lowdiff.ReplicaOptions, got {type(replica).__name__}"
        )
    remote = RemoteOptions.of(given["remote"])
    if given["method_options"]:
        raise InvalidArgumentError(
            f"method_options= is for registered methods; method {method!r} takes its options "
            "as Checkpointer arguments"
        )
    return dict(
        compressor=given["compressor"],
        full_every=given["full_every"],
        batch_size=given["records_per_file"],
        keep_full=given["keep_full"],
        max_inflight=given["max_inflight"],
        on_storage_error=given["on_storage_error"],
        mtbf=given["mtbf"],
        max_lag=replica.max_lag,
        persist_every=replica.persist_every,
        replica_threads=replica.threads,
        peer_copies=replica.peer_copies,
        peer_address=replica.peer_address,
        start_timeout=timeouts.start,
        stall_timeout=timeouts.stall,
        idle_timeout=timeouts.idle,
        sigterm_timeout=timeouts.sigterm,
        remote=None if remote is None else remote.url,
        remote_options=None if remote is None else remote.storage_options,
        remote_bandwidth=None if remote is None else remote.bandwidth,
        remote_timeout=60.0 if remote is None else remote.timeout,
    )


def _registered_options(method: str, cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """The options a registered method's class is built with: the shared ones, and
    ``method_options`` (each checked against what the class takes); one of lowdiff's own
    options with another value is refused."""
    if given["extra_state"]:
        raise InvalidArgumentError(
            "extra_state is supported by lowdiff's own methods ('lowdiff', 'lowdiff+', "
            f"'compression-only'), not by the registered method {method!r}"
        )
    for name, default in _DEFAULTS.items():
        if given[name] != default:
            raise InvalidArgumentError(
                f"method {method!r} takes no option {name!r} (it is an option of lowdiff's "
                "own methods); pass the method's own options as method_options={...}"
            )
    own = dict(given["method_options"] or {})
    if not isinstance(given["method_options"] or {}, Mapping):
        raise ArgumentTypeError(f"method_options must be a dict, got {type(own).__name__}")
    takes = _init_options(cls)
    if takes is not None:
        for name in sorted(set(own) - takes):
            raise ArgumentTypeError(
                f"Checkpointer(method={method!r}) takes no option {name!r}"
                f"{did_you_mean(name, sorted(takes), renamed=False)} (its options: {', '.join(sorted(takes))})"
            )
    out: dict[str, Any] = {"full_every": given["full_every"], "keep_full": given["keep_full"]}
    for name in ("compressor", "scheduler"):
        if given[name] is not None:
            out[name] = given[name]
    if given["timeouts"] is not None:
        out["start_timeout"] = given["timeouts"].start
    return {**out, **own}


def _init_options(cls: type) -> set[str] | None:
    """The keyword options ``cls(model, optimizer, directory, ...)`` takes, or None when it
    takes any (``**kwargs`` all the way up)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        params = inspect.signature(init).parameters.values()
        names |= {
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in ("self", "model", "optimizer", "directory")
        }
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return None


class Checkpointer:
    """Per-iteration checkpointing that reuses the gradients training applies.

    ``ck.step()`` replaces ``optimizer.step()`` and ``scheduler.step()`` in the loop (or
    use :func:`lowdiff.attach` to keep the loop as it is).

    Args:
        directory: the checkpoint directory (created if missing). It must be empty or a
            lowdiff checkpoint directory. Ignored (may be None) for
            ``method="compression-only"``.
        model: the model being trained (a plain module, one wrapped in DDP, or one
            sharded with ``fully_shard``).
        optimizer: any ``torch.optim`` optimizer over the model's parameters.
        method: ``"auto"`` (default): ``"lowdiff"`` when a compressor is given, else
            ``"lowdiff+"``. ``"lowdiff"``: each step's compressed gradient is its
            differential checkpoint (training applies the compressed gradient, as it
            would with the compressor alone). ``"lowdiff+"``: training is unchanged;
            gradients are snapshotted layer by layer into a CPU replica that is persisted
            in the background and survives a training crash. ``"compression-only"``:
            trains with the compressor and writes nothing (a reference to measure
            against). Or a method registered with :func:`lowdiff.register_method` (the
            baselines of ``lowdiff_lab``).
        compressor: the gradient compressor (``lowdiff.TopK(ratio=0.01)``, ...). None
            (default): the optimizer applies exactly the gradients it would without
            lowdiff.
        full_every: f, a full checkpoint every f steps (and at step 0), or ``"auto"``
            (method ``"lowdiff"``, single process): start at 30 and set f to the
            argmin of the paper's wasted-time model (:mod:`lowdiff.plan`) once the costs
            are profiled, then re-plan as they drift. With ``"auto"`` the next full
            checkpoint comes f steps after the previous one.
        records_per_file: b, records per file (one write per b steps), or ``"auto"`` (start at
            3, then as for ``full_every``). Changes are logged (logger ``lowdiff.plan``)
            and listed in :attr:`plan_history`; recovery does not depend on f or b.
        scheduler: optional LR scheduler; ``step()`` steps it after the optimizer.
        keep_full: full checkpoints to keep (records older than the oldest kept one are
            deleted), default 2: the steps from the older kept one on stay restorable;
            None keeps everything (every step since the start).
        max_inflight: records that may wait in shared memory for the checkpointing
            process before ``step()`` blocks; default ``2 * records_per_file + 2``.
        mtbf: with ``"auto"`` (LowDiff's f and b, LowDiff+'s ``ReplicaOptions.persist_every``): the
            job's mean time between failures in seconds; default: the environment
            variable ``LOWDIFF_MTBF`` (seconds), else 6 hours.
        on_storage_error: what a storage error of the checkpointing process (``ENOSPC``,
            ``EIO``, ...) does. ``"raise"``: the next ``step()`` raises
            :class:`CheckpointWorkerError`. ``"warn"`` (method ``"lowdiff"`` only):
            training goes on without checkpointing, a :class:`DurabilityWarning` says how
            many steps are not durable, and lowdiff retries with a full checkpoint at the
            next multiple of ``full_every``.
        extra_state: lowdiff's own methods: training state beyond model, optimizer and
            scheduler, as ``{"name": obj}`` where ``obj`` has ``state_dict()`` and
            ``load_state_dict()`` (a data loader's position, a sampler, a ``GradScaler``,
            a dict-like of counters). Captured at every step with the record (after the
            scheduler stepped) and restored by ``resume()`` and
            ``lowdiff.restore(..., extra_state=...)``. Saved as JSON with tensors inline,
            never pickled; a state that cannot be saved so is a ``TypeError`` naming the
            object and the value, raised where it is first captured: by ``resume()`` on an
            empty directory (the step-0 full checkpoint), else by the first ``step()``.
        replica: ``lowdiff.ReplicaOptions``: LowDiff+'s CPU replica (lag, persist
            interval, threads).
        remote: a second, remote tier: an fsspec URL (``"s3://bucket/run"``) or
            ``lowdiff.RemoteOptions``. Methods ``"lowdiff"`` and ``"lowdiff+"``, in one
            process or under DDP. The checkpointing process uploads every file it writes
            in a thread of its own; :attr:`remote_durable_step` says how far it reaches,
            and ``resume()`` with an empty local directory recovers from it.
        timeouts: ``lowdiff.Timeouts``: how long lowdiff waits for its processes and on
            SIGTERM.
        method_options: a registered method's own options, as a dict.

    Raises:
        InvalidArgumentError: a bad value (a ``ValueError``), naming the option.
        ArgumentTypeError: a value of the wrong type, or an option that does not exist
            (a ``TypeError``), naming it.
        UnsupportedSetupError: a setup the method does not support.

    Example:
        >>> ck = lowdiff.Checkpointer("runs/ckpt", model, opt)  # doctest: +SKIP
        >>> start = ck.resume()  # doctest: +SKIP
        >>> for step in range(start, 1000):  # doctest: +SKIP
        ...     loss_fn(model, batch_for(step)).backward()
        ...     ck.step()
        ...     opt.zero_grad()
        >>> ck.close()  # doctest: +SKIP
    """

    __slots__ = ("_impl",)

    @accepts_old_spellings("Checkpointer", OPTIONS)
    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        method: Method | str = "auto",
        compressor: Compressor | None = None,
        scheduler: Any | None = None,
        extra_state: dict[str, Any] | None = None,
        full_every: int | Literal["auto"] = 30,
        records_per_file: int | Literal["auto"] = 3,
        keep_full: int | None = 2,
        max_inflight: int | None = None,
        on_storage_error: Literal["raise", "warn"] = "raise",
        mtbf: float | None = None,
        replica: ReplicaOptions | None = None,
        remote: RemoteOptions | str | None = None,
        timeouts: Timeouts | None = None,
        method_options: Mapping[str, Any] | None = None,
    ) -> None:
        refuse_in_bootstrap("lowdiff.Checkpointer")
        given = dict(
            compressor=compressor, scheduler=scheduler, extra_state=extra_state,
            full_every=full_every, records_per_file=records_per_file, keep_full=keep_full,
            max_inflight=max_inflight, on_storage_error=on_storage_error, mtbf=mtbf,
            replica=replica, remote=remote, timeouts=timeouts, method_options=method_options,
        )  # fmt: skip
        if compressor is not None and not isinstance(compressor, Compressor):
            raise ArgumentTypeError(
                f"compressor must be a lowdiff.Compressor, got {type(compressor).__name__}"
            )
        name = resolve_method(method, compressor)
        cls = methods.method_class(name)
        st.check_training_objects(model, optimizer, scheduler)
        if methods.is_builtin(name):
            options = _engine_options(name, given)
            options.update(scheduler=scheduler, extra_state=extra_state)
        else:
            options = _registered_options(name, cls, given)
        forkmem.keep_out(model, optimizer)  # before a process server is forked from here
        self._impl: Strategy = cls(model, optimizer, directory, **options)

    @property
    def method(self) -> str:
        """The method in use (``"auto"`` resolved: ``"lowdiff"`` or ``"lowdiff+"``)."""
        return self._impl.name

    @property
    def strategy(self) -> str:
        """Deprecated: :attr:`method`."""
        warnings.warn("Checkpointer.strategy is deprecated; use .method", DeprecationWarning, 2)
        return self._impl.name

    @property
    def strategy_impl(self) -> Strategy:
        """The method's object (internal: its attributes are not a stable API)."""
        return self._impl

    def resume(self) -> int:
        """Restore the newest recoverable state, or prepare an empty directory.

        Restores model parameters and buffers, optimizer state, scheduler state, RNG
        states and ``extra_state``. Files past the recovered step, and damaged files,
        are moved to ``DIR/quarantine/`` (never deleted). Under DDP every rank calls it,
        and they resume at one agreed step. A checkpointing process that outlived the
        previous trainer is taken over; a new one starts while the first forward and
        backward run, and the first ``step()`` returns once it has taken the state.

        Returns:
            The recovered step (0 for an empty directory).

        Raises:
            UsageError: a second call, a call after the first ``step()``, or after
                ``close()`` (build a new Checkpointer to go on).
        """
        if self._impl.is_closed:
            raise UsageError(
                "resume() after close(): this Checkpointer has let go of its directory; "
                "build a new Checkpointer to resume from it"
            )
        return self._impl.resume()

    def step(self, metric: float | None = None) -> None:
        """Take the gradients as the optimizer will apply them, run the optimizer (and
        the scheduler), record the step, and checkpoint when due. Call it where the loop
        called ``optimizer.step()`` and ``scheduler.step()``.

        Args:
            metric: passed to ``scheduler.step(metric)`` (for ReduceLROnPlateau).

        Raises:
            UsageError: after ``close()``, or on a Checkpointer made by
                :func:`lowdiff.attach` (the loop calls ``optimizer.step()`` itself).
        """
        self._impl.step(metric)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip the gradients of the optimizer's parameters by their total norm: the
        same norm, factor and bits as ``torch.nn.utils.clip_grad_norm_`` over them. Call
        it where the loop clipped, between backward and :meth:`step` (or
        ``optimizer.step()`` under :func:`lowdiff.attach`).

        With ``method="lowdiff+"`` the gradients were already copied to host memory
        during backward; this call carries the clipping factor to the replica, which
        multiplies its copies by it, so each gradient goes to host memory once per step.
        A clip that ``torch.nn.utils.clip_grad_norm_`` makes instead is detected and
        stays exact, but its gradients are copied after it (on a GPU: not overlapped
        with backward). Under ``fully_shard`` both are the same.

        Returns:
            The total norm of the gradients (as one vector), as torch returns it.
        """
        return self._impl.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def flush(self, remote: bool = False) -> int:
        """Make everything taken so far durable and wait for it; the newest durable step.

        Under DDP this is a collective call (every rank calls it at the same point): it
        returns the newest step that every shard has made durable.

        Args:
            remote: also wait until the remote tier can recover that step, and return
                the remote durable step. Raises :class:`lowdiff.RemoteStorageError` when
                uploads make no progress for ``RemoteOptions.timeout`` seconds.
        """
        if remote:
            return self._impl.flush_remote()
        return self._impl.flush()

    def close(self) -> None:
        """Flush everything, wait until it is durable and stop the background work."""
        self._impl.close()

    # ------------------------------------------------------------------ attach
    def capture_after_update(self, name: str) -> None:
        """With :func:`lowdiff.attach`: take ``extra_state[name]`` for each step when
        :meth:`recapture` is next called after its update, instead of right after the
        update. For state the loop changes after ``optimizer.step()`` returned and that
        belongs to the step: a framework's global step or epoch counters."""
        self._attached("capture_after_update").capture_after_update(name)

    def recapture(self, name: str) -> None:
        """With :func:`lowdiff.attach`: take ``extra_state[name]`` now for the steps
        waiting for it (see :meth:`capture_after_update`)."""
        self._attached("recapture").recapture(name)

    def retake(self, name: str) -> None:
        """With :func:`lowdiff.attach`: take ``extra_state[name]`` again now for every
        step not handed over yet, replacing what was taken for it (state a framework
        changes after the step's update: an evaluation, a log or a save of the step)."""
        self._attached("retake").retake(name)

    def _attached(self, what: str) -> Any:
        if not self._impl.driven_by_hooks:
            raise UsageError(
                f"{what}() applies to a Checkpointer made by lowdiff.attach(), whose steps "
                "are taken by optimizer.step()"
            )
        return self._impl

    # ------------------------------------------------------------------ state
    @property
    def step_count(self) -> int:
        """Optimizer updates done so far (the step the live state is at)."""
        return self._impl.step_count

    @property
    def durable_step(self) -> int:
        """Newest step whose state is recoverable from disk (-1 before the first write).

        Under DDP: the newest step every rank's shard has made durable, as of the previous
        ``step()`` (it never runs ahead of any shard); after ``flush()`` or ``close()`` on
        every rank, the job's last step.
        """
        return self._impl.durable_step

    @property
    def acknowledged_step(self) -> int:
        """Newest step whose checkpoint data is in host memory and handed to the
        checkpointing process: a crash of the training process loses no step up to it
        (-1 before the first hand-over; with ``"compression-only"``, which writes
        nothing, always -1, as :attr:`durable_step`).

        On a CPU trainer it is the step ``ck.step()`` just finished. On a GPU, LowDiff's
        record (and a full checkpoint) is copied to host memory while the next step runs,
        and this trails :attr:`step_count` by at most one step; ``flush()`` and
        ``close()`` catch it up. Driven by the optimizer's hooks (:func:`lowdiff.attach`),
        a step is handed over when the next update begins. Under DDP: this rank's.
        """
        return self._impl.acknowledged_step

    @property
    def remote_durable_step(self) -> int:
        """Newest step recoverable from the remote tier (-1 before the first, and always
        without ``remote=``). It trails :attr:`durable_step` by the uploads in flight
        (``flush(remote=True)`` waits for them); under DDP the job's, as for
        :attr:`durable_step`."""
        return self._impl.remote_durable_step

    @property
    def stats(self) -> dict[str, float]:
        """Counters of this session, times in seconds summed over the session: the
        trainer's waits, the checkpointing process's writes and, with ``remote=``, the
        uploads (each key in the reference's "Statistics" table)."""
        return self._impl.stats

    @property
    def timings(self) -> StepTimings:
        """Seconds the training process spent in each stage of ``step()``, summed over
        the session (:class:`lowdiff.StepTimings`; ``.overhead_s`` is lowdiff's own)."""
        return StepTimings.of(self._impl.pipeline_s)

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """With ``"auto"``: every (f, b) this session used, oldest first."""
        return self._impl.plan_history

    @property
    def recovery_stats(self) -> RecoveryStats | None:
        """:class:`lowdiff.RecoveryStats` of :meth:`resume`, or None."""
        return self._impl.recovery_stats  # type: ignore[no-any-return]

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained."""
        return self._impl.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose updates are checkpointed (a framework's wrapper unwrapped)."""
        return self._impl.optimizer

    @property
    def scheduler(self) -> Any | None:
        """The LR scheduler, or None."""
        return self._impl.scheduler

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._impl.__exit__(exc_type, *exc)  # close() (errors kept off an exception's way)

    def __repr__(self) -> str:
        return f"Checkpointer({self._impl!r})"
