"""SIGKILL the trainer, the checkpointing process or both at hook points and at random
times, under LowDiff and LowDiff+; every recovery reaches the acknowledged step with the
reference state."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowdiff_lab.torture import workload
from lowdiff_lab.torture.crash import N_STEPS, CrashHarness
from lowdiff_lab.torture.report import TortureReport

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PLANS = [
    # the checkpointing process dies between the fsync and the rename of a record file
    {"target": "worker", "how": "hook", "spec": "before_rename:records:2:kill-self"},
    # the trainer dies while its checkpointing process is about to fsync a record file;
    # the orphaned process must still write every record it was handed
    {"target": "trainer", "how": "hook", "spec": "before_fsync:records:2:kill-parent"},
    # both die during a full checkpoint
    {"target": "both", "how": "hook", "spec": "before_rename:full:2:kill-both"},
    # the checkpointing process dies in the middle of retention
    {"target": "worker", "how": "hook", "spec": "retention:any:2:kill-self"},
    # the trainer dies while it rewrites the manifest during resume
    {"target": "trainer", "how": "hook", "spec": "before_rename:manifest:1:kill-self"},
    # both die at a random time while training
    {"target": "both", "how": "time", "phase": "training", "delay": 0.3},
]


def test_kills_at_hook_points_and_random_times(prefork, tmp_path, torture_report) -> None:
    ref = workload.reference(N_STEPS)
    report = TortureReport()
    plans = [dict(p, point=p.get("spec", "random time")) for p in PLANS]
    plans.append({"target": "none", "how": "check", "point": "final check"})
    CrashHarness(tmp_path, ref, report, seed=1, server=prefork).run(plans)
    torture_report.merge(report)
    assert report.failures == []
    assert report.kills == len(PLANS)
    assert report.recoveries == report.recoveries_ok >= len(PLANS)
    assert report.wrong_states == report.lost_acknowledged == report.lost_handed_off == 0
    assert report.margin_min is not None and report.margin_min >= 0


PLUS_PLANS = [
    # the trainer dies while its replica is about to fsync a full checkpoint; the replica
    # stays in memory and the next trainer resumes from it
    {"target": "trainer", "how": "hook", "spec": "before_fsync:full:2:kill-parent"},
    # the replica dies in the middle of retention; the trainer resumes from disk
    {"target": "worker", "how": "hook", "spec": "retention:any:2:kill-self"},
]


def test_lowdiff_plus_kills_recover_from_memory_and_disk(prefork, tmp_path, torture_report) -> None:
    ref = workload.reference(N_STEPS, plus=True)
    report = TortureReport()
    plans = [dict(p, point=p["spec"]) for p in PLUS_PLANS]
    plans.append({"target": "none", "how": "check", "point": "final check"})
    CrashHarness(tmp_path, ref, report, seed=2, strategy="lowdiff+", server=prefork).run(plans)
    torture_report.merge(report)
    assert report.failures == []
    assert report.kills == report.kills_by_strategy["lowdiff+"] == len(PLUS_PLANS)
    assert report.recoveries == report.recoveries_ok >= len(PLUS_PLANS)
    assert report.recoveries_by_source["lowdiff+ memory"] >= 1
    assert report.recoveries_by_source["lowdiff+ disk"] >= 1
    assert report.wrong_states == report.lost_acknowledged == report.lost_handed_off == 0
    assert report.margin_min is not None and report.margin_min >= 0


def test_lowdiff_plus_survivors_are_taken_over_or_refused(
    prefork, tmp_path, torture_report
) -> None:
    """Adoption in the kill mix: the session after a trainer-only kill takes the surviving
    replica process over; a session of another job (another keep_full) is refused by the
    survivor, which persists and exits; nothing is left behind."""
    ref = workload.reference(N_STEPS, plus=True)
    report = TortureReport()
    kill = {"target": "trainer", "how": "time", "phase": "training", "point": "random time"}
    plans = [
        dict(kill, delay=0.3),
        dict(kill, delay=0.3),
        {"target": "none", "how": "check", "point": "final check", "foreign": True},
    ]
    CrashHarness(tmp_path, ref, report, seed=3, strategy="lowdiff+", server=prefork).run(plans)
    torture_report.merge(report)
    assert report.failures == []
    assert report.kills == 2
    assert report.adoptions == 1 and report.refused_survivors == 1
    assert report.recoveries_by_source["lowdiff+ memory"] == 2
    assert report.wrong_states == report.lost_acknowledged == report.lost_handed_off == 0
    assert report.leaked == 0


def test_an_orphan_segment_is_reported_and_a_mapped_one_is_not(tmp_path: Path) -> None:
    """The end-of-series check: a segment of one of the series' runs (listed by a
    manifest under its work directory) made during the series that no live process maps
    is a leak (one that no directory's descriptor names any more); one a live process
    maps is not, and neither is an unmapped one of another lowdiff job on the machine."""
    import uuid

    from lowdiff.format import layout
    from lowdiff.format.sfile import FORMAT_NAME, FORMAT_VERSION
    from lowdiff.proc import holder as rp
    from lowdiff_lab.torture.crash import _check_orphan_segments, _lowdiff_segments

    before = _lowdiff_segments()
    run, other = uuid.uuid4().hex, uuid.uuid4().hex
    (tmp_path / "chain-0").mkdir()
    body = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "run_id": run, "runs": [run]}
    layout.write_manifest(tmp_path / "chain-0", body)
    tag, elsewhere = run[:16], other[:16]
    orphan = rp.create_segment(f"lowdiff-{tag}-orphan", 4096)
    mapped = rp.create_segment(f"lowdiff-{tag}-mapped", 4096)
    foreign = rp.create_segment(f"lowdiff-{elsewhere}-orphan", 4096)
    orphan.close()  # nobody maps it any more
    foreign.close()
    try:
        report = TortureReport()
        _check_orphan_segments(before, report, tmp_path, wait_s=0.0)
        assert report.leaked == 1 and not report.ok
        assert f"lowdiff-{tag}-orphan" in report.failures[0]
        assert f"lowdiff-{tag}-mapped" not in report.failures[0]
        assert f"lowdiff-{elsewhere}-orphan" not in report.failures[0]
    finally:
        mapped.close()
        for name in (
            f"lowdiff-{tag}-orphan",
            f"lowdiff-{tag}-mapped",
            f"lowdiff-{elsewhere}-orphan",
        ):
            rp.unlink_segment(name)
