"""Accounting of a synthetic event log: every piece where it belongs, and the sum exact."""

from __future__ import annotations

import pytest

from lowdiff_lab.chaos.accounting import Attempt, account


def _log() -> list[Attempt]:
    # Times are multiples of 1/4, exact in binary: every sum below is exact.
    first = Attempt(  # startup 1.0, steps 1..4 (new), killed 0.5 into step 5
        start_t=10.0,
        resumed_t=11.0,
        resumed_step=0,
        steps=[(1, 12.0), (2, 13.0), (3, 14.0), (4, 15.0)],
        end_t=15.5,
        killed=True,
        kind="software",
    )
    second = Attempt(  # restart 2.0, resume 1.5 (restore 0.25); redo 3, 4; new 5; killed
        start_t=17.5,
        resumed_t=19.0,
        resumed_step=2,
        steps=[(3, 20.0), (4, 21.0), (5, 22.0)],
        end_t=22.75,
        killed=True,
        kind="hardware",
        restore_s=0.25,
        recovery={"source": "disk", "total_s": 0.25},
    )
    third = Attempt(  # restart 1.25, resume 0.5 (restore 4.0: clamped to 0.5); new 6; close 0.25
        start_t=24.0,
        resumed_t=24.5,
        resumed_step=5,
        steps=[(6, 25.5)],
        end_t=25.75,
        killed=False,
        restore_s=4.0,
        recovery={"source": "memory", "total_s": 4.0},
        close_s=0.25,
    )
    return [first, second, third]


def test_every_piece_and_the_sum() -> None:
    acc = account(_log(), reference_s=6.5, reference_startup_s=0.25)
    assert acc.total_s == 15.75
    assert acc.startup_s == 1.0
    assert acc.new_s == 4.0 + 1.0 + 1.0  # steps 1-4, 5, 6
    assert acc.redone_s == 2.0  # steps 3 and 4 again
    assert acc.tail_s == 0.5 + 0.75
    assert acc.restart_s == 2.0 + 1.25
    assert acc.resume_s == 1.5 + 0.5
    assert acc.restore_s == 0.25 + 0.5
    assert acc.close_s == 0.25
    assert (acc.failures, acc.steps_new, acc.steps_redone) == (2, 6, 2)
    assert acc.recovered_steps == [2, 5]
    assert acc.failed_at_steps == [4, 5]
    assert acc.recovery_sources == ["disk", "memory"]
    # the pieces cover the time line
    pieces = (
        acc.startup_s + acc.new_s + acc.redone_s + acc.tail_s + acc.restart_s + acc.resume_s
    ) + acc.close_s
    assert pieces == acc.total_s
    # the wasted time splits into startup, steady overhead, lost work and recovery
    assert acc.wasted_s == 15.75 - 6.5
    assert acc.startup_overhead_s == 0.75
    assert acc.overhead_s == 6.0 + 0.25 - (6.5 - 0.25)
    assert acc.lost_work_s == 3.25
    assert acc.recovery_s == 5.25
    assert acc.startup_overhead_s + acc.overhead_s + acc.lost_work_s + acc.recovery_s == (
        acc.wasted_s
    )
    assert acc.effective_ratio == 6.5 / 15.75
    d = acc.as_dict()
    assert d["resume_other_s"] == 2.0 - 0.75 and d["wasted_s"] == acc.wasted_s


def test_a_run_without_failures_is_its_own_reference() -> None:
    one = _log()[0]
    one.killed = False
    one.end_t = 15.25
    ref = account([one], 0.0)
    acc = account([one], ref.total_s, ref.startup_s)
    assert acc.wasted_s == acc.overhead_s == acc.startup_overhead_s == 0.0
    assert acc.effective_ratio == 1.0 and acc.failures == 0


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda log: log.clear(), "at least one attempt"),
        (lambda log: setattr(log[-1], "killed", True), "every attempt but the last"),
        (lambda log: setattr(log[0], "killed", False), "every attempt but the last"),
        (lambda log: setattr(log[1], "resumed_t", 17.0), "backwards"),
        (lambda log: setattr(log[2], "start_t", 22.0), "backwards|before the previous"),
    ],
)
def test_inconsistent_logs_are_refused(mutate, match: str) -> None:
    log = _log()
    mutate(log)
    with pytest.raises(ValueError, match=match):
        account(log, 6.5)


def test_a_step_finished_but_not_reported_before_the_kill_counts_as_new() -> None:
    # the first attempt reports steps 1..4 and is killed after step 5's update was handed
    # over but before it reported it: the second attempt resumes at 5 and goes on with 6
    log = _log()
    log[1] = Attempt(
        start_t=17.5,
        resumed_t=19.0,
        resumed_step=5,
        steps=[(6, 20.0)],
        end_t=20.5,
        killed=False,
        restore_s=0.25,
        recovery={"source": "disk", "total_s": 0.25},
    )
    acc = account(log[:2], reference_s=6.5)
    assert (acc.failures, acc.steps_new, acc.steps_redone) == (1, 6, 0)
