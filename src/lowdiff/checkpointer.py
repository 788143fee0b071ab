"""``lowdiff.Checkpointer``: one object for every checkpointing strategy.

It validates the arguments, picks the strategy by name and hands every call to it; the
strategies (lowdiff's own and the baselines) implement :class:`lowdiff.strategy.Strategy`,
whose ``step()`` is the one step pipeline. ``isinstance(ck, lowdiff.Checkpointer)`` holds
whatever the strategy.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import os
from typing import Any

import torch

from lowdiff.baselines import BASELINES
from lowdiff.proc import forkmem
from lowdiff.proc.spawn import refuse_in_bootstrap
from lowdiff.state import capture as st
from lowdiff.strategy import Strategy

_OWN: dict[str, str] = {
    "lowdiff": "lowdiff.engine.lowdiff:LowDiffStrategy",
    "lowdiff+": "lowdiff.engine.lowdiff_plus:LowDiffPlusStrategy",
    "none": "lowdiff.engine.none:NoCheckpointStrategy",
}
_STRATEGIES: dict[str, str] = {**_OWN, **BASELINES}
"""Strategy name -> ``module:class`` (imported on first use)."""

STRATEGIES: tuple[str, ...] = tuple(_STRATEGIES)


def strategy_modules() -> tuple[str, ...]:
    """The modules of every strategy (imported on first use), for a process server that
    imports ahead what a training job will (:mod:`lowdiff.prefork`)."""
    return tuple(dict.fromkeys(v.partition(":")[0] for v in _STRATEGIES.values()))


def strategy_class(name: str) -> type[Strategy]:
    """The class implementing strategy ``name``."""
    if name not in _STRATEGIES:
        raise ValueError(
            f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {name!r}"
        )
    module, _, cls_name = _STRATEGIES[name].partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    assert isinstance(cls, type) and issubclass(cls, Strategy)
    return cls


@functools.cache
def strategy_options(cls: type[Strategy]) -> frozenset[str]:
    """The keyword options strategy class ``cls`` takes (``Checkpointer``'s ``**options``).

    Read from the code objects of the Python ``__init__`` methods of the class and its
    bases (``inspect.signature`` parses a built-in's signature from text, which costs
    milliseconds at every start of a process forked from a server).
    """
    from lowdiff.engine.base import EngineStrategy  # noqa: PLC0415 -- imported on first use
    from lowdiff.engine.options import EngineOptions  # noqa: PLC0415

    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is EngineStrategy:
            names |= {f.name for f in dataclasses.fields(EngineOptions)}
        init = klass.__dict__.get("__init__")
        if not inspect.isfunction(init):
            continue
        code = init.__code__
        # positional-or-keyword, then keyword-only (positional-only ones cannot be named)
        named = code.co_varnames[
            code.co_posonlyargcount : code.co_argcount + code.co_kwonlyargcount
        ]
        names |= set(named) - {"self", "model", "optimizer", "directory"}
        if not code.co_flags & inspect.CO_VARKEYWORDS:
            break
    return frozenset(names)


def _check_options(strategy: str, cls: type[Strategy], options: dict[str, Any]) -> None:
    """A clear error for an option the strategy does not take (a typo, another
    strategy's option), with the nearest name it takes."""
    known = strategy_options(cls)
    for name in sorted(set(options) - known):
        near = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise TypeError(
            f"lowdiff.Checkpointer(strategy={strategy!r}) takes no option {name!r}{hint} "
            f"(its options: {', '.join(sorted(known))})"
        )


class Checkpointer:
    """Per-iteration checkpointing that reuses the gradients training applies.

    Args:
        model: the model being trained (a plain module, or one wrapped in DDP).
        optimizer: any ``torch.optim`` optimizer over the model's parameters.
        directory: the checkpoint directory (created if missing). It must be empty or
            a lowdiff checkpoint directory. Ignored by ``strategy="none"``.
        strategy: ``"lowdiff"`` (compressed-gradient records), ``"lowdiff+"`` (no
            compression: layer-wise gradient snapshots merged into a CPU replica that is
            persisted in the background and survives a training crash), or ``"none"``
            (same compression as ``"lowdiff"``, no checkpointing). Or one of the baselines
            ``"torch-save"``, ``"checkfreq"``, ``"gemini"``, ``"naive-dc"`` and
            ``"dcp-async"`` (see :mod:`lowdiff.baselines`; each takes its own options).
        compressor: the gradient compressor; default ``TopK(ratio=0.01)``. Must be None
            for ``"lowdiff+"``.
        full_every: f, a full checkpoint every f steps (and at step 0), or ``"auto"``
            (strategy ``"lowdiff"``, single process): start at 30 and set f to the
            argmin of the paper's wasted-time model (:mod:`lowdiff.plan`) once the costs
            are profiled, then re-plan as they drift. With ``"auto"`` the next full
            checkpoint comes f steps after the previous one.
        batch_size: b, records per file (one write per b steps), or ``"auto"`` (start at
            3, then as for ``full_every``). Changes are logged (logger ``lowdiff.plan``)
            and listed in :attr:`plan_history`; recovery does not depend on f or b.
        scheduler: optional LR scheduler; ``step()`` steps it after the optimizer.
        keep_full: full checkpoints to keep (records older than the oldest kept one are
            deleted), default 2: the steps from the older kept one on stay restorable;
            None keeps everything (every step since the start).
        max_inflight: records that may wait in shared memory for the checkpointing
            process before ``step()`` blocks; default ``2 * batch_size + 2``.
        start_timeout: seconds to wait for the checkpointing process to start, or for a
            previous session's checkpointing process to finish writing.
        stall_timeout: seconds the trainer waits on a live checkpointing process that makes
            no progress (writes nothing, handles nothing) before it raises
            :class:`CheckpointWorkerError`. A process that is still writing (a large full
            checkpoint, a slow disk) is waited for as long as it makes progress; a dead one
            raises at once.
        max_lag: LowDiff+ only: how many steps the CPU replica may trail the trainer
            before ``step()`` waits (also the number of gradient snapshot buffers).
        persist_every: LowDiff+ only: persist the replica every this many steps, or
            ``"auto"`` (default): at the Young–Daly interval ``sqrt(2 C M)`` seconds, C
            the time one persist took and M the MTBF (``mtbf``), writing at most half
            the time (under DDP: every ``full_every`` steps, the same steps on every rank).
        idle_timeout: strategies ``"lowdiff"`` and ``"lowdiff+"``: seconds the
            checkpointing process of a trainer that died waits for the next trainer on the
            same directory to take it over (LowDiff+'s replica, with the state in memory;
            LowDiff's writer, once it wrote every record it was sent), before it persists
            what it holds and exits. 0: it exits at once.
        replica_threads: LowDiff+ only: parallel shards of the replica's update (whole
            tensors, balanced by size, one thread each; the same bits as one thread).
        sigterm_timeout: strategies ``"lowdiff"`` and ``"lowdiff+"``: on SIGTERM (a
            scheduler reclaiming the node, a preemption), wait up to this many seconds
            until every step whose ``step()`` returned is durable (each rank its own
            shard, no collective), then go on as SIGTERM would have had it: exit status
            -15, or the SIGTERM handler the process set before its first
            ``Checkpointer``, which is kept and called after lowdiff's (with the signal
            and the frame). Default 30, the grace period Kubernetes and Slurm give by
            default. None leaves SIGTERM alone.
        mtbf: with ``"auto"`` (LowDiff's f and b, LowDiff+'s ``persist_every``): the
            job's mean time between failures in seconds; default: the environment
            variable ``LOWDIFF_MTBF`` (seconds), else 6 hours.
        on_storage_error: what a storage error of the checkpointing process (``ENOSPC``,
            ``EIO``, ...) does. ``"raise"``: the next ``step()`` raises
            :class:`CheckpointWorkerError`. ``"warn"`` (strategy ``"lowdiff"`` only):
            training goes on without checkpointing, a :class:`DurabilityWarning` says how
            many steps are not durable, and lowdiff retries with a full checkpoint at the
            next multiple of ``full_every``.
        extra_state: lowdiff's strategies: training state beyond model, optimizer and
            scheduler, as ``{"name": obj}`` where ``obj`` has ``state_dict()`` and
            ``load_state_dict()`` (a data loader's position, a sampler, a ``GradScaler``,
            a dict-like of counters). Captured at every step with the record (after the
            scheduler stepped) and restored by ``resume()`` and
            ``lowdiff.restore(..., extra_state=...)``. Saved as JSON with tensors inline,
            never pickled; a state that cannot be saved so is a ``TypeError`` naming the
            object and the value, raised where it is first captured: by ``resume()`` on an
            empty directory (the step-0 full checkpoint), else by the first ``step()``.
        remote: strategies ``"lowdiff"`` and ``"lowdiff+"``, in one process or under DDP
            (refused under ``fully_shard``): a second, remote tier as any fsspec URL
            (``"s3://bucket/run"``, ``"gcs://..."``, ``"file:///mnt/shared/run"``). The
            checkpointing process uploads every record file and full checkpoint it writes
            (LowDiff+: every full checkpoint it persists) in a thread of its own,
            publishing each through a commit object (see ``docs/format.md``);
            :attr:`remote_durable_step` says how far it reaches, and ``resume()`` with an
            empty local directory recovers from it. Under DDP each rank uploads its own
            shard directory to the same relative folder under the URL (rank 0 the job's
            manifests too).
        remote_options: keyword arguments for the fsspec file system (credentials,
            ``endpoint_url``, ``client_kwargs``, ...), passed through unchanged.
        remote_bandwidth: upload cap in bytes per second; None (default): no cap.
        remote_timeout: seconds ``flush(remote=True)`` and ``close()`` wait for uploads
            that make no progress (an unreachable endpoint) before they raise
            :class:`lowdiff.RemoteStorageError`; default 60.

    Every other keyword goes to the strategy (a baseline's own options, such as
    ``persist_every`` of ``"gemini"``); an option a strategy does not take is a
    ``TypeError`` naming it.

    Example:
        >>> ck = lowdiff.Checkpointer(model, opt, "runs/ckpt", compressor=lowdiff.TopK(0.01))  # doctest: +SKIP
        >>> start = ck.resume()  # doctest: +SKIP
        >>> for step in range(start, 1000):  # doctest: +SKIP
        ...     loss_fn(model, batch_for(step)).backward()
        ...     ck.step()
        ...     opt.zero_grad()
        >>> ck.close()  # doctest: +SKIP
    """

    __slots__ = ("_impl",)
    # The facade holds the strategy and nothing else: its attributes are the typed
    # properties below; a strategy's own state is reached through ``strategy_impl``.

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        strategy: str = "lowdiff",
        **options: Any,
    ) -> None:
        refuse_in_bootstrap("lowdiff.Checkpointer")
        if not isinstance(strategy, str):
            raise TypeError(f"strategy must be a str, got {type(strategy).__name__}")
        cls = strategy_class(strategy)
        st.check_training_objects(model, optimizer, options.get("scheduler"))
        if strategy not in _OWN:
            if options.get("extra_state"):
                raise ValueError(
                    f"extra_state is supported by lowdiff's own strategies ({', '.join(map(repr, _OWN))}), "
                    f"not by the baseline {strategy!r}"
                )
            options.pop("extra_state", None)
        _check_options(strategy, cls, options)
        forkmem.keep_out(model, optimizer)  # before a process server is forked from here
        self._impl: Strategy = cls(model, optimizer, directory, **options)

    @property
    def strategy_impl(self) -> Strategy:
        """The strategy object doing the work (:class:`lowdiff.strategy.Strategy`)."""
        return self._impl

    @property
    def strategy(self) -> str:
        """The strategy's name."""
        return self._impl.name

    # ------------------------------------------------------------------ the API
    def resume(self) -> int:
        """Restore the newest recoverable state, or prepare an empty directory.

        Restores model parameters and buffers, optimizer state, scheduler state and RNG
        states. Files past the recovered step, and damaged files, are moved to
        ``DIR/quarantine/`` (never deleted). The error-feedback residuals restart at zero.
        Under DDP every rank calls it, and they resume at one agreed step.

        A checkpointing process that outlived the previous trainer is taken over; a new
        one is started without waiting for it: the first forward and backward run while
        it starts, and the first ``step()`` returns once it has taken the state staged
        for its first full checkpoint (only the living trainer can hand that over). A
        start that fails raises :class:`CheckpointWorkerError` (or the start's own error)
        from here or from the first ``step()`` or ``flush()`` after it failed.

        Returns:
            The recovered step (0 for an empty directory).

        Raises:
            RuntimeError: a second call, a call after the first ``step()``, or after
                ``close()`` (a closed Checkpointer has let go of its directory: build a
                new one to go on).
        """
        if self._impl.is_closed:
            raise RuntimeError(
                "resume() after close(): this Checkpointer has let go of its directory; "
                "build a new Checkpointer to resume from it"
            )
        return self._impl.resume()

    def step(self, metric: float | None = None) -> None:
        """Take the gradients as the optimizer will apply them, log the step, run the
        optimizer (and scheduler), and checkpoint when due.

        Args:
            metric: passed to ``scheduler.step(metric)`` (for ReduceLROnPlateau).
        """
        self._impl.step(metric)

    def flush(self, remote: bool = False) -> int:
        """Make everything taken so far durable and wait for it; the newest durable step.

        Under DDP this is a collective call (every rank calls it at the same point): it
        returns the newest step that every shard has made durable.

        Args:
            remote: also wait until the remote tier (``remote=``) can recover that step,
                and return the remote durable step (under DDP the job's: every rank
                waits for its own uploads, then the ranks take the minimum). Raises
                :class:`lowdiff.RemoteStorageError` when uploads make no progress for
                ``remote_timeout`` seconds (the local tier is not affected); under DDP
                on every rank when any rank's uploads stalled.
        """
        if remote:
            return self._impl.flush_remote()
        return self._impl.flush()

    def close(self) -> None:
        """Flush everything, wait until it is durable and stop the background work."""
        self._impl.close()

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
    def remote_durable_step(self) -> int:
        """Newest step recoverable from the remote tier (``remote=``): a committed full
        checkpoint and committed record files reaching it. -1 before the first such
        chain, and always without ``remote=``. It trails :attr:`durable_step` by the
        uploads in flight (``flush(remote=True)`` waits for them).

        Under DDP: the newest step every rank's shard has committed remotely, exchanged
        with :attr:`durable_step` in the same background all-reduce (as of the previous
        ``step()``, never ahead of any shard); after ``flush(remote=True)`` or ``close()``
        on every rank, the job's last step once every upload is committed."""
        return self._impl.remote_durable_step

    @property
    def stats(self) -> dict[str, float]:
        """Counters and timings of this session; times in seconds, summed over the session.

        lowdiff's strategies report, on the training side: ``steps``; ``slot_wait_s``
        (waiting for a free record slot: the checkpointing process fell behind),
        ``record_send_s`` (filling and handing over records), ``full_wait_s`` and
        ``full_copy_s`` (waiting for the staging buffer, copying the state into it),
        ``fulls_requested``; LowDiff+: ``snapshot_finish_s`` and ``lag_wait_s`` (the
        replica ``max_lag`` steps behind). From the checkpointing process:
        ``records_written``, ``record_files_written``, ``record_bytes``,
        ``record_write_s``, ``fulls_written``, ``full_bytes``, ``full_write_s``;
        LowDiff+: ``replica_merges``, ``replica_merge_s``. With ``remote=``:
        ``remote_durable_step``, ``remote_files``, ``remote_bytes``, ``remote_upload_s``,
        ``remote_errors`` (failed upload attempts, each retried). And ``durable_step``,
        ``record_row_bytes``, ``full_every``, ``batch_size``, and ``slots_pinned`` (1.0
        when the slots a GPU copies records or snapshots into are page-locked: copies run
        asynchronously; 0.0 on CPU training, or where pinning failed, with a warning
        saying why). The baselines report
        ``steps``, ``checkpoints``, ``stall_s`` (time ``step()`` was blocked),
        ``bytes_written``, ``write_s`` and their own counters.
        """
        return self._impl.stats

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """With ``"auto"``: every (f, b) this session used, oldest first (see
        :attr:`lowdiff.engine.base.EngineStrategy.plan_history`)."""
        return self._impl.plan_history

    @property
    def recovery_stats(self) -> Any:
        """:class:`lowdiff.RecoveryStats` of :meth:`resume`, or None."""
        return self._impl.recovery_stats

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained (as passed in)."""
        return self._impl.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose updates are checkpointed (a framework's wrapper unwrapped
        by :func:`lowdiff.attach`)."""
        return self._impl.optimizer

    @property
    def scheduler(self) -> Any | None:
        """The LR scheduler, or None."""
        return self._impl.scheduler

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._impl.__exit__(exc_type, *exc)

    def __repr__(self) -> str:
        return f"Checkpointer({self._impl!r})"
