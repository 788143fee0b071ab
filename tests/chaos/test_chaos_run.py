"""Real chaos runs: training processes killed (software and hardware failures) and restarted.

LowDiff with top-k without error feedback is exact: after a software and a hardware failure
the job finishes its steps in a state bit-identical to the uninterrupted training.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lowdiff_lab.chaos import procs
from lowdiff_lab.chaos.accounting import account
from lowdiff_lab.chaos.launch import ForkLauncher, child_env
from lowdiff_lab.chaos.schedule import FailurePoint, FailureSchedule
from lowdiff_lab.chaos.supervisor import Job, supervise
from lowdiff_lab.demo import compare_states

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 24
TAU = 0.03  # nominal: the schedules below are given in steps


def _schedule(*points: tuple[int, float]) -> FailureSchedule:
    return FailureSchedule(
        mtbf_s=1.0,
        seed=0,
        horizon_s=STEPS * TAU,
        tau_s=TAU,
        points=tuple(FailurePoint(i, (s + f) * TAU, s, f) for i, (s, f) in enumerate(points)),
    )


def _config(**kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": "gpt2-tiny",
        "steps": STEPS,
        "batch_size": 2,
        "seq_len": 32,
        "threads": 1,
        "eval_batches": 1,
        "full_every": 5,
        "batch_size_records": 2,
        "compressor": {"kind": "topk", "ratio": 0.05, "error_feedback": False},
    }
    cfg.update(kw)
    return cfg


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkLauncher]:
    d = tmp_path_factory.mktemp("launcher")
    with ForkLauncher(child_env(1), d / "server.log") as la:
        yield la


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_lowdiff_through_a_software_and_a_hardware_failure_ends_exact(
    launcher: ForkLauncher, tmp_path: Path
) -> None:
    dump_ref, dump_run = tmp_path / "ref.safetensors", tmp_path / "run.safetensors"
    ref = supervise(
        Job(
            "reference",
            _config(strategy="none", dump_state_at_step={"step": STEPS, "path": str(dump_ref)}),
        ),
        None,
        launcher,
        tmp_path,
    )
    assert len(ref.attempts) == 1 and ref.result["start_step"] == 0

    run = supervise(
        Job(
            "lowdiff",
            _config(strategy="lowdiff", dump_state_at_step={"step": STEPS, "path": str(dump_run)}),
            kind=("software", "hardware"),
        ),
        _schedule((7, 0.5), (16, 0.3)),
        launcher,
        tmp_path,
    )
    a = run.attempts
    assert [x.killed for x in a] == [True, True, False]
    assert [x.kind for x in a] == ["software", "hardware", None]
    assert [k["kind"] for k in run.kills] == ["software", "hardware"]
    # a software failure kills the trainer alone; the writer it leaves flushes every
    # record it was handed, so nothing before the kill is lost
    assert len(run.kills[0]["pids"]) == 1
    failed = a[0].steps[-1][0]
    assert failed >= 7 and a[1].resumed_step in (failed, failed + 1)
    # a hardware failure takes the checkpointing process (and its shared memory) too
    assert len(run.kills[1]["pids"]) >= 2
    assert not set(run.kills[1]["segments_removed"]) & _shm()
    assert a[1].steps[-1][0] >= 16 and a[2].resumed_step <= a[1].steps[-1][0]
    assert a[1].recovery is not None and a[1].recovery["source"] == "disk"
    assert a[2].steps[-1][0] == STEPS and run.result["start_step"] == a[2].resumed_step
    assert run.not_injected == 0 and run.leftovers_killed == []
    assert not procs.holders(tmp_path / "lowdiff" / "ckpt")

    state = compare_states(dump_run, dump_ref)
    assert state["bit_identical"], state

    t_ref = account(ref.attempts, 0.0)
    acc = account(a, t_ref.total_s, t_ref.startup_s)
    assert acc.failures == 2 and acc.steps_new == STEPS
    assert acc.recovery_s > 0 and acc.restart_s > 0
    assert acc.startup_overhead_s + acc.overhead_s + acc.lost_work_s + acc.recovery_s == (
        pytest.approx(acc.wasted_s)
    )


def test_lowdiff_plus_recovers_from_memory_after_software_and_from_disk_after_hardware(
    launcher: ForkLauncher, tmp_path: Path
) -> None:
    cfg = _config(strategy="lowdiff+", compressor={"kind": "none"}, steps=16)
    sched = FailureSchedule(
        mtbf_s=1.0,
        seed=0,
        horizon_s=16 * TAU,
        tau_s=TAU,
        points=(FailurePoint(0, 5 * TAU, 5, 0.0), FailurePoint(1, 11 * TAU, 11, 0.0)),
    )
    run = supervise(Job("plus", cfg, kind=("software", "hardware")), sched, launcher, tmp_path)
    a = run.attempts
    assert len(a) == 3
    assert a[1].recovery is not None and a[1].recovery["source"] == "memory"
    assert a[2].recovery is None or a[2].recovery["source"] == "disk"
    # the replica's segments were mapped by the killed processes, and are gone
    assert any(s.startswith("lowdiff-") for s in run.kills[1]["segments_removed"])
    assert not set(run.kills[1]["segments_removed"]) & _shm()
    assert a[-1].steps[-1][0] == 16
    assert not procs.holders(tmp_path / "plus" / "ckpt")
