"""A sample of the 2-rank DDP kill series (``lowdiff torture --ddp N``).

One rank of a 2-rank gloo job under ``torchrun --max-restarts 1`` SIGKILLs itself at a
step that is neither a full checkpoint nor a record-file boundary; the restarted job must
resume at least at every acknowledged durable step (and, after a trainer-only kill, at the
step every rank handed off) and end with the state of an uninterrupted run.
"""

from __future__ import annotations

import pytest

from lowdiff_lab.torture.ddp import KILL_STEPS, plan_kills, run_ddp_kills

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SEED = 1  # rank 0 before its forward pass at step 14, rank 1 after its backward at step 11


def test_kill_steps_are_misaligned():
    assert KILL_STEPS and all(s % 3 and s % 6 for s in KILL_STEPS)


def test_two_rank_kills_lose_no_acknowledged_step(prefork, tmp_path):
    plans = plan_kills(2, SEED, "lowdiff")
    assert {k.rank for k in plans} == {0, 1}
    assert {k.point for k in plans} == {"before-forward", "after-backward"}
    lines: list[str] = []
    report = run_ddp_kills(
        tmp_path, 2, seed=SEED, strategy="lowdiff", log=lines.append, server=prefork
    )
    assert report.failures == [], "\n".join(lines)
    # each kill landed where it was planned (the job wrote the marker just before SIGKILL)
    for i, k in enumerate(plans):
        assert (tmp_path / f"kill-{i:03d}" / "out" / "killed").read_text() == k.marker
    assert report.kills == 2 and report.recoveries == report.recoveries_ok == 2
    assert report.kills_by_point == {"before-forward": 1, "after-backward": 1}
    assert report.wrong_states == 0
    assert report.lost_acknowledged == report.lost_acknowledged_steps == 0
    assert report.lost_handed_off == 0
    assert report.margin_min is not None and report.margin_min >= 0
    assert report.ok
