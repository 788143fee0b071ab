"""The four runs of ``lowdiff demo`` and the report they make.

The demo runs the training job of :mod:`lowdiff_lab.workloads.train` four times, each as a
real child process, one after the other (two CPU-bound jobs side by side would disturb
each other's timings):

a) ``method="lowdiff"``; SIGKILLed when it reports a randomly chosen step (seeded by
   ``seed``, between 40% and 80% of the run);
b) the same job restarted on the same directory: it resumes, dumps its whole training
   state right after ``resume()``, and finishes;
c) ``method="compression-only"`` (same compression, no checkpointing) uninterrupted, dumping its
   state at the step (b) recovered: the reference;
d) ``method="lowdiff"`` uninterrupted in a fresh directory, timed against (c);
e) in this process, the longest replay the files (d) kept allow (for LowDiff+: the
   recovery from disk).

It then compares the two dumps tensor by tensor with ``torch.equal``, reads the record and
full-checkpoint sizes of (d)'s directory, and builds the report.

Example:
    >>> report = orchestrate(demo_settings(quick=True))  # doctest: +SKIP
    >>> report["state_check"]["bit_identical"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowdiff_lab.bench.core import machine_info
from lowdiff_lab.demo.analysis import compare_states, overhead_stats, storage_stats
from lowdiff_lab.demo.children import Children, ChildRun, require_ok, run_child
from lowdiff_lab.demo.settings import DemoError, DemoSettings, kill_target
from lowdiff_lab.harness import Progress, child_env
from lowdiff_lab.prefork import PreforkError, PreforkServer
from lowdiff_lab.workloads.train import PRELOAD


class _StepProgress:
    """The demo's progress bar: every step the runs train, followed through their events.

    The bar starts at three runs' worth of steps ((a) and (b) together train one run, and
    (c) and (d) one each) and grows by the steps (b) trains again after its resume.
    """

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._last = 0

    def phase(self, desc: str, start_step: int = 0) -> None:
        """A new run begins (its steps count from ``start_step``)."""
        self._last = start_step
        self.progress(desc)

    def follow(self, ev: dict[str, Any]) -> bool:
        """Take one event of the running job; never asks for a kill."""
        if ev.get("event") == "resumed":
            self._last = int(ev.get("step", 0))
        elif ev.get("event") == "step":
            s = int(ev["step"])
            if s > self._last:
                self.progress.advance(s - self._last, loss=f"{ev.get('loss', float('nan')):.3f}")
            self._last = max(self._last, s)
        return False


class _Demo:
    """One demo run: its files, environment, children and progress."""

    def __init__(self, s: DemoSettings, progress: _StepProgress) -> None:
        self.s = s
        self.bar = progress
        self.env = child_env(s.threads)
        # the runs are forks of one server that imported torch and the job once: each
        # run then starts at its model build, not at an interpreter's start
        try:
            server = PreforkServer(PRELOAD, env=self.env, log_path=s.out_dir / "fork-server.log")
        except PreforkError as e:
            raise DemoError(str(e)) from e
        self.children = Children(server)
        out = s.out_dir
        self.ck_killed = out / "ckpt-killed"
        self.ck_fresh = out / "ckpt-uninterrupted"
        self.ck_none = out / "none"
        self.dump_resume = out / "state-recovered.safetensors"
        self.dump_ref = out / "state-reference.safetensors"
        self.res_resumed = out / "result-resumed.json"
        self.res_ref = out / "result-reference.json"
        self.res_fresh = out / "result-uninterrupted.json"

    def config(self, directory: Path, strategy: str, **extra: Any) -> dict[str, Any]:
        """The training config of one run (``extra``: its dumps and result file)."""
        s, p = self.s, self.s.profile
        return {
            "directory": str(directory),
            "model": p.model,
            "seed": s.seed,
            "steps": p.steps,
            "batch_size": p.train_batch_size,
            "seq_len": p.seq_len,
            "lr": p.lr,
            "strategy": strategy,
            "compressor": s.compressor,
            "full_every": p.full_every,
            "batch_size_records": p.batch_size,
            "keep_full": p.keep_full,
            "threads": s.threads,
            "eval_batches": p.eval_batches,
            **extra,
        }

    def killed(self, target: int) -> ChildRun:
        """(a) The run that dies: SIGKILLed when it reports step ``target``."""
        self.bar.phase("a) train, SIGKILL")

        def kill_when_reached(ev: dict[str, Any]) -> bool:
            self.bar.follow(ev)
            return ev.get("event") == "step" and int(ev["step"]) >= target

        cfg = self.config(self.ck_killed, self.s.strategy)
        run = run_child("a-killed", cfg, self.s.out_dir, self.env, self.children, kill_when_reached)
        if run.killed_at is None:
            require_ok(run)
            raise DemoError(f"the first run ended before reaching step {target}")
        return run

    def resumed(self, killed: ChildRun) -> dict[str, Any]:
        """(b) The restart on the same directory: resume, dump, finish; its result."""
        self.bar.phase("b) resume, finish")
        cfg = self.config(
            self.ck_killed,
            self.s.strategy,
            dump_state_at_resume=str(self.dump_resume),
            result_path=str(self.res_resumed),
        )

        def follow_resume(ev: dict[str, Any]) -> bool:
            if ev.get("event") == "resumed":
                # Steps between the recovered one and the kill are trained twice.
                self.bar.progress.grow(int(killed.killed_at or 0) - int(ev.get("step", 0)))
            return self.bar.follow(ev)

        self._run("b-resumed", cfg, follow_resume)
        return _read_json(self.res_resumed)

    def reference(self, recovered: int) -> dict[str, Any]:
        """(c) The reference without checkpointing, dumping at the recovered step."""
        self.bar.phase("c) reference (compression-only)")
        cfg = self.config(
            self.ck_none,
            "none",
            dump_state_at_step={"step": recovered, "path": str(self.dump_ref)},
            result_path=str(self.res_ref),
        )
        self._run("c-reference", cfg, self.bar.follow)
        return _read_json(self.res_ref)

    def uninterrupted(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(d) The uninterrupted run, timed against (c) (never run beside it); its result
        and its config."""
        self.bar.phase("d) uninterrupted lowdiff")
        cfg = self.config(self.ck_fresh, self.s.strategy, result_path=str(self.res_fresh))
        self._run("d-uninterrupted", cfg, self.bar.follow)
        return _read_json(self.res_fresh), cfg

    def worst_case(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        """(e) The longest replay the files of (d) allow, timed in a new process started
        as the restart (b) was, so that it pays what (b)'s recovery paid the first time
        (the first optimizer step, the first decode) and bounds it."""
        plus = self.s.strategy == "lowdiff+"
        self.bar.phase("e) recovery from disk" if plus else "e) worst-case recovery")
        run = run_child(
            "e-worst-case", cfg, self.s.out_dir, self.env, self.children,
            args=("--probe-recovery", str(self.ck_fresh)),
        )  # fmt: skip
        require_ok(run)
        probes = [ev for ev in run.events if ev.get("event") == "probe"]
        if not probes:
            raise DemoError("the worst-case recovery process reported nothing")
        return probes[-1]["recovery"]

    def _run(
        self, name: str, cfg: dict[str, Any], follow: Callable[[dict[str, Any]], bool]
    ) -> None:
        require_ok(run_child(name, cfg, self.s.out_dir, self.env, self.children, follow))


def orchestrate(s: DemoSettings) -> dict[str, Any]:
    """Run the phases and build the report dict (see the module docstring).

    Raises:
        DemoError: a run failed, or the first one ended before its kill.
    """
    t0 = time.perf_counter()
    p = s.profile
    target = kill_target(s.seed, p.steps)
    progress = Progress(quiet=not s.progress, total=3 * p.steps)
    demo = _Demo(s, _StepProgress(progress))
    try:
        killed = demo.killed(target)
        resumed = demo.resumed(killed)
        recovered = int(resumed["start_step"])
        reference = demo.reference(recovered)
        fresh, cfg = demo.uninterrupted()
        worst = demo.worst_case(cfg)
    finally:
        progress.close()
        demo.children.kill_all((demo.ck_killed, demo.ck_fresh))
        demo.children.close()

    state = compare_states(demo.dump_resume, demo.dump_ref)
    state["step"] = recovered
    return {
        "model": {"name": p.model, "n_params": fresh["n_params"]},
        "steps": p.steps,
        "seed": s.seed,
        "strategy": s.strategy,
        "compressor": s.compressor,
        "full_every": p.full_every,
        "batch_size": p.batch_size,
        "keep_full": p.keep_full,
        "train_batch_size": p.train_batch_size,
        "seq_len": p.seq_len,
        "kill": {
            "target_step": target,
            "kill_step": killed.killed_at,
            "durable_at_kill": killed.durable_at_kill,
            "recovered_step": recovered,
            "killed_returncode": killed.returncode,
        },
        "state_check": state,
        "loss": {
            "recovered_final": resumed["final_loss_mean10"],
            "reference_final": reference["final_loss_mean10"],
            "recovered_final_last_step": resumed["final_loss"],
            "reference_final_last_step": reference["final_loss"],
            "recovered_eval": resumed["eval_loss"],
            "reference_eval": reference["eval_loss"],
        },
        "storage": storage_stats(demo.ck_fresh, int(fresh["n_params"]), s.compressor),
        "recovery": resumed["recovery"],
        "recovery_worst_case": worst,
        "overhead": overhead_stats(reference, fresh),
        "trainer_stats": fresh.get("ck_stats"),
        "machine": {**machine_info("cpu"), "threads_per_run": s.threads},
        "out_dir": str(s.out_dir),
        "wall_s": time.perf_counter() - t0,
    }


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


__all__ = ["orchestrate"]
