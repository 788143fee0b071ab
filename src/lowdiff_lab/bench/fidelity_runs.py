"""The live runs of ``lowdiff bench fidelity`` (Exp. 6): training jobs side by side in
one process, the failing child, and recovery.

A :class:`Run` is one training job alive in this process (a case, or the uninterrupted
reference) with random streams of its own (:class:`RunRng`), swapped in around its steps
so that runs trained in lockstep train exactly as each would alone.
:func:`failing_child` is the process that trains the cases to the failure step and dies
by SIGKILL; :func:`recover` rebuilds a case from what it left; :func:`release` shuts down
what a killed child left alive when its case is not recovered.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import lowdiff
from lowdiff_lab import checkpointers
from lowdiff_lab.bench.core import BenchSettings, build_workload, crash_after, make_optimizer
from lowdiff_lab.bench.fidelity_metrics import difference, model_tensors
from lowdiff_lab.bench.fidelity_plan import Case, Setting
from lowdiff_lab.workloads import zoo

CHILD_ERROR_EXIT = 3
"""Exit status of a failing-process child that raised before its failure step."""


@dataclass
class RunRng:
    """A run's own random streams, swapped into the process around its steps."""

    torch_state: torch.Tensor
    python: Any
    numpy: Any
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls) -> RunRng:
        """The process's streams as they are now (CUDA's only once CUDA is in use)."""
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda)

    def install(self) -> None:
        """Make these the process's streams."""
        torch.set_rng_state(self.torch_state)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


@dataclass
class Run:
    """One training job alive in this process: a case, or the reference."""

    label: str
    workload: zoo.Workload
    optimizer: torch.optim.Optimizer
    ck: Any
    rng: RunRng
    step: int = 0
    case: Case | None = None
    recovery: dict[str, Any] = field(default_factory=dict)
    measured: bool = False
    trace: dict[str, list[Any]] = field(
        default_factory=lambda: {"step": [], "model_max_abs_diff": [], "loss_abs_diff": []}
    )

    @property
    def case_key(self) -> str:
        """The setting key of the case ("" for a reference)."""
        return "" if self.case is None else self.case.setting.key

    def train_step(self) -> float:
        """One optimizer step on this run's own random streams; returns the loss."""
        self.rng.install()
        loss = self.workload.forward_backward(self.step)
        if self.ck is None:
            self.optimizer.step()
        else:
            self.ck.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.rng = RunRng.capture()
        self.step += 1
        return loss

    def record(self, ref: Run, loss_diff: float | None) -> None:
        """Add ΔModel against ``ref`` (at the same step) to the trace."""
        d = difference(model_tensors(self.workload.model), model_tensors(ref.workload.model))
        self.trace["step"].append(self.step)
        self.trace["model_max_abs_diff"].append(d.max_abs)
        self.trace["loss_abs_diff"].append(loss_diff)

    def close(self) -> None:
        """Close the run's Checkpointer (once; later calls do nothing)."""
        if self.ck is not None:
            ck, self.ck = self.ck, None
            ck.close()


def case_checkpointer(
    case: Case, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Any:  # lowdiff.Checkpointer or a baseline
    """The case's Checkpointer on its own directory, in its setting's compression."""
    a = case.arm
    return checkpointers.build(
        case.directory,
        model,
        opt,
        a.strategy or "none",
        compressor=None if a.strategy == "lowdiff+" else case.setting.compressor(),
        full_every=a.full_every,
        **dict(a.options),
    )


def reference_run(s: BenchSettings, setting: Setting) -> Run:
    """The uninterrupted job: compressed training without checkpoints, or the plain loop."""
    wl = build_workload(s)
    opt = make_optimizer(wl.model, s.lr)
    ck = None
    if setting.ratio is not None:
        ck = lowdiff.Checkpointer(
            None, wl.model, opt, method="compression-only", compressor=setting.compressor()
        )
        ck.resume()
    return Run("Baseline", wl, opt, ck, RunRng.capture())


def failing_child(settings: dict[str, Any], cases: list[Case], steps: int, threads: int) -> None:
    """(child) Train every case in lockstep to ``steps``, make it durable, die by SIGKILL."""

    def train() -> None:
        torch.set_num_threads(threads)
        s = BenchSettings.from_dict(settings)
        runs: list[Run] = []
        for c in cases:
            wl = build_workload(s)  # seeds the global RNG: the weights and dropout of every run
            opt = make_optimizer(wl.model, s.lr)
            ck = case_checkpointer(c, wl.model, opt)
            if ck.resume() != 0:
                raise RuntimeError(f"{c.directory} was not empty")
            runs.append(Run(c.arm.label, wl, opt, ck, RunRng.capture(), case=c))
        for _ in range(steps):
            for r in runs:
                r.train_step()
        for r in runs:
            r.ck.flush()

    crash_after(train, CHILD_ERROR_EXIT)


def recover(s: BenchSettings, case: Case) -> Run:
    """The case rebuilt in fresh objects and resumed from what the killed child left;
    the run's ``recovery`` holds the recovered step, ``resume()``'s wall time and the
    strategy's recovery stats."""
    wl = build_workload(s)
    opt = make_optimizer(wl.model, s.lr)
    t0 = time.perf_counter()
    ck = case_checkpointer(case, wl.model, opt)
    step = ck.resume()
    resume_s = time.perf_counter() - t0
    rs = ck.recovery_stats
    rec = {
        "recovered_step": step,
        "resume_s": resume_s,
        "recovery_source": getattr(rs, "source", None),
        "records_replayed": getattr(rs, "records_replayed", None),
        "recovery_full_step": getattr(rs, "full_step", None),
    }
    return Run(case.arm.label, wl, opt, ck, RunRng.capture(), step=step, case=case, recovery=rec)


def release(s: BenchSettings, case: Case) -> None:
    """Attach to what a killed child left alive (a replica, a holder) and shut it down."""
    with contextlib.suppress(Exception):
        recover(s, case).close()
