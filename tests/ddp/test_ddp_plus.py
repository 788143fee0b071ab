"""Distributed LowDiff+: 2 ranks on gloo under torchrun (lowdiff_lab.torture.ddp_job).

- each rank's replica holds a disjoint shard of parameters and optimizer state, and the
  union of the shards equals every trainer's state;
- a SIGKILLed rank under ``torchrun --max-restarts 1``: the restarted ranks rebuild the
  whole state from the replicas in memory, and the job finishes exactly like an
  uninterrupted run;
- elastic restarts (``--max-restarts 2``: a rank SIGKILLed mid-run, later an exception in
  the other rank): every restarted rank takes over the replica process that outlived its
  predecessor, recovers from memory, and the job ends bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lowdiff.format import layout
from lowdiff.state.capture import diff_states
from lowdiff.state.record import RecordLayout

from .test_ddp_lowdiff import _load, attempts

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_sharded_replica_equals_the_trainers(torchrun, tmp_path):
    ck, o1, o2 = tmp_path / "ck", tmp_path / "o1", tmp_path / "o2"
    o1.mkdir()
    o2.mkdir()
    torchrun(
        "--dir",
        str(ck),
        "--out",
        str(o1),
        "--strategy",
        "lowdiff+",
        "--steps",
        "9",
        "--save-steps",
        "9",
    )
    names = [
        {
            p.name
            for p in RecordLayout.from_json(
                layout.read_manifest(ck / f"rank-{r:05d}")["record_layout"]
            ).params
        }
        for r in (0, 1)
    ]
    assert names[0].isdisjoint(names[1]) and len(names[0] | names[1]) == 8
    # the replicas exited at close: the resumed job reads their persisted shards
    torchrun("--dir", str(ck), "--out", str(o2), "--strategy", "lowdiff+", "--steps", "9")
    for r in (0, 1):
        assert (
            diff_states(_load(o1 / f"state-9-rank{r}.pt"), _load(o2 / f"resumed-9-rank{r}.pt"))
            == []
        )


def test_clip_through_lowdiff_carries_the_factor_and_equals_torch_clip(torchrun, tmp_path):
    """Every rank clips with ``ck.clip_grad_norm_`` (firing on every step): each gradient
    is copied once per step, the factor travels to the replicas, and the job ends where
    the same job clipping with torch ends; the replicas' shards equal the trainers."""
    runs = {}
    for via in ("torch", "lowdiff"):
        out = tmp_path / f"o-{via}"
        out.mkdir()
        torchrun(
            "--dir", str(tmp_path / f"ck-{via}"), "--out", str(out), "--strategy", "lowdiff+",
            "--steps", "8", "--save-steps", "8", "--clip", "0.05", "--clip-via", via,
        )  # fmt: skip
        runs[via] = out
    out = runs["lowdiff"]
    for r in (0, 1):
        (clipped,) = out.glob(f"clipped-rank{r}-*.txt")
        assert clipped.read_text() == "8 8"  # the clip fired on every step
        (copies,) = out.glob(f"copies-rank{r}-*.txt")
        n_copies, scaled, n_params, steps = map(int, copies.read_text().split())
        assert n_copies == n_params * steps and scaled >= 1
        assert (
            diff_states(
                _load(runs["torch"] / f"final-rank{r}.pt"), _load(out / f"final-rank{r}.pt")
            )
            == []
        )
    # the replicas exited at close: a resumed job reads their persisted shards
    o2 = tmp_path / "o2"
    o2.mkdir()
    torchrun("--dir", str(tmp_path / "ck-lowdiff"), "--out", str(o2), "--strategy", "lowdiff+", "--steps", "8")  # fmt: skip
    for r in (0, 1):
        assert (
            diff_states(_load(out / f"state-8-rank{r}.pt"), _load(o2 / f"resumed-8-rank{r}.pt"))
            == []
        )


COMMON = ("--strategy", "lowdiff+", "--steps", "12")


@pytest.fixture(scope="module")
def reference(torchrun, tmp_path_factory) -> Path:
    """The uninterrupted run (final states ``final-rank{r}.pt``)."""
    base = tmp_path_factory.mktemp("plus-ref")
    ref = base / "out"
    ref.mkdir()
    torchrun("--dir", str(base / "ck"), "--out", str(ref), *COMMON)
    return ref


def test_sigkill_one_rank_recovers_from_the_replicas_in_memory(torchrun, tmp_path, reference):
    ref, run = reference, tmp_path / "run"
    run.mkdir()
    common = COMMON
    torchrun(
        "--dir",
        str(tmp_path / "ck-run"),
        "--out",
        str(run),
        "--kill-rank",
        "1",
        "--kill-at",
        "7",
        *common,
        restarts=1,
    )
    assert (run / "killed").read_text() == "7 before-forward"
    starts = sorted(f.read_text() for f in run.glob("start-rank*.txt"))
    assert starts == ["0 fresh", "0 fresh", "7 memory", "7 memory"]
    for r in (0, 1):
        assert diff_states(_load(ref / f"final-rank{r}.pt"), _load(run / f"final-rank{r}.pt")) == []


def test_elastic_restarts_take_over_the_surviving_replica_processes(torchrun, tmp_path, reference):
    run = tmp_path / "run"
    run.mkdir()
    torchrun(
        "--dir", str(tmp_path / "ck"), "--out", str(run), *COMMON,
        "--kill-rank", "1", "--kill-at", "4", "--raise-rank", "0", "--raise-at", "8",
        restarts=2,
    )  # fmt: skip
    assert (run / "killed").read_text() == "4 before-forward"
    assert (run / "raised").read_text() == "8"
    for r in (0, 1):
        starts, pids = attempts(run, r)
        assert starts == ["0 fresh", "4 memory", "8 memory"]
        first = pids[0][0]
        # one replica process per rank for the whole job: each restart took it over
        assert pids == [(first, -1), (first, first), (first, first)], pids
        assert (
            diff_states(_load(reference / f"final-rank{r}.pt"), _load(run / f"final-rank{r}.pt"))
            == []
        )


def test_rank_raising_on_its_first_attempt_leaves_its_replica_and_exits(
    torchrun, tmp_path, reference
):
    """Rank 0 raises in its first attempt: it exits at once (its interpreter does not wait
    for the replica it leaves running), torchrun restarts the job, and every rank resumes
    from its replica in memory, bit-identical at the end."""
    run = tmp_path / "run"
    run.mkdir()
    torchrun(
        "--dir", str(tmp_path / "ck"), "--out", str(run), *COMMON,
        "--raise-rank", "0", "--raise-at", "5", restarts=1,
    )  # fmt: skip
    assert (run / "raised").read_text() == "5"
    for r in (0, 1):
        starts, _ = attempts(run, r)
        assert starts == ["0 fresh", "5 memory"]
        assert (
            diff_states(_load(reference / f"final-rank{r}.pt"), _load(run / f"final-rank{r}.pt"))
            == []
        )
