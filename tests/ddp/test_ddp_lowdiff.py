"""Distributed LowDiff: 2 ranks on gloo, started by torchrun (lowdiff_lab.torture.ddp_job).

- the hook's merged sparse gradient is exactly what every rank's optimizer applied;
- persistence is sharded: each rank's files hold only its share of the parameters;
- resuming replays every shard's records to the exact state of every rank;
- a SIGKILLed rank under ``torchrun --max-restarts 1`` restarts the job, which agrees on
  one step and finishes with the state of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff.format import layout, sfile
from lowdiff.state.capture import diff_states
from lowdiff.state.record import RecordLayout

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


PER_RANK = ("model/body.1.running_mean", "model/body.1.running_var", "rng.")


def test_merge_shards_and_exact_resume(torchrun, tmp_path):
    ck, out1, out2 = tmp_path / "ck", tmp_path / "o1", tmp_path / "o2"
    out1.mkdir()
    out2.mkdir()
    # --check-merge asserts, every step on every rank, that the hook's record decompresses to
    # exactly the .grad the optimizer then applies, and that both ranks hold the same .grad
    torchrun("--dir", str(ck), "--out", str(out1), "--ef", "--check-merge", "--save-steps", "12")
    s0, s1 = _load(out1 / "state-12-rank0.pt"), _load(out1 / "state-12-rank1.pt")
    # model parameters and optimizer state are identical on both ranks; only the per-rank
    # state (BatchNorm statistics between broadcasts, RNG streams) differs
    assert [k for k in diff_states(s0, s1) if not k.startswith(PER_RANK)] == []

    # sharded persistence: disjoint shards that cover every parameter, in files and records
    assert layout.read_manifest(ck)["world_size"] == 2
    shards, layouts = [], []
    for r in (0, 1):
        d = ck / f"rank-{r:05d}"
        rl = RecordLayout.from_json(layout.read_manifest(d)["record_layout"])
        layouts.append({p.name for p in rl.params})
        lf = sfile.read(d / "full" / "full-000000000010.safetensors")
        shards.append(sorted(lowdiff.format.codec.loads(lf.metadata["shard"])))
        params_in_file = {
            k[len("model/") :] for k in lf.tensors if k.startswith("model/") and "running" not in k
        }
        params_in_file.discard("body.1.num_batches_tracked")
        assert params_in_file == layouts[r]
    assert set(shards[0]).isdisjoint(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(8))
    assert layouts[0].isdisjoint(layouts[1]) and len(layouts[0] | layouts[1]) == 8

    # resume: the full checkpoint of step 10 and two records from each shard
    torchrun("--dir", str(ck), "--out", str(out2), "--ef", "--steps", "12")
    for r in (0, 1):
        assert (out2 / f"resumed-12-rank{r}.pt").exists()
        assert (
            diff_states(
                _load(out1 / f"state-12-rank{r}.pt"), _load(out2 / f"resumed-12-rank{r}.pt")
            )
            == []
        )


def test_sigkill_of_one_rank_under_torchrun_max_restarts(torchrun, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d in (ref, run):
        d.mkdir()
    common = ("--steps", "16", "--full-every", "6", "--batch-size", "2")
    torchrun("--dir", str(tmp_path / "ck-ref"), "--out", str(ref), *common)
    p = torchrun(
        "--dir",
        str(tmp_path / "ck-run"),
        "--out",
        str(run),
        "--kill-rank",
        "1",
        "--kill-at",
        "11",
        *common,
        restarts=1,
        agent="exec",  # the real torchrun CLI
    )
    assert (run / "killed").read_text() == "11 before-forward", p.stderr[-3000:]
    starts = sorted(int(f.read_text().split()[0]) for f in run.glob("start-rank*.txt"))
    # first attempt starts both ranks at 0; the restart starts both at one agreed step
    assert starts[:2] == [0, 0] and len(starts) == 4
    assert starts[2] == starts[3] and 0 < starts[2] <= 11
    for r in (0, 1):
        want, got = _load(ref / f"final-rank{r}.pt"), _load(run / f"final-rank{r}.pt")
        assert diff_states(want, got) == []


def _clipped(out: Path) -> list[tuple[int, int]]:
    return [tuple(map(int, f.read_text().split())) for f in sorted(out.glob("clipped-rank*.txt"))]


def test_clipping_that_fires_replays_exactly(torchrun, tmp_path):
    """Clipping changes .grad after the hook merged it: the record must be what was applied."""
    ck, out1, out2 = tmp_path / "ck", tmp_path / "o1", tmp_path / "o2"
    out1.mkdir()
    out2.mkdir()
    common = ("--dir", str(ck), "--clip", "0.05", "--full-every", "5", "--batch-size", "2")
    torchrun(*common, "--out", str(out1), "--save-steps", "12", "--steps", "12")
    # the clip fired on every step of both ranks (the gradient norm is far above 0.05)
    assert _clipped(out1) == [(12, 12), (12, 12)]
    # flush() is collective and reports the step every shard made durable
    assert [f.read_text() for f in out1.glob("flushed-rank*.txt")] == ["12", "12"]
    # the full checkpoint of step 10 and the clipped records of steps 10 and 11
    torchrun(*common, "--out", str(out2), "--steps", "12")
    for r in (0, 1):
        want = _load(out1 / f"state-12-rank{r}.pt")
        assert diff_states(want, _load(out2 / f"resumed-12-rank{r}.pt")) == []


def test_rank_killed_between_backward_and_step_with_clipping(torchrun, tmp_path):
    """A rank dies after its gradients were merged and clipped-to-be, before ck.step():
    the restarted job agrees on a step and ends exactly where an uninterrupted run does."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d in (ref, run):
        d.mkdir()
    common = ("--steps", "14", "--full-every", "6", "--batch-size", "3", "--clip", "0.05")
    torchrun("--dir", str(tmp_path / "ck-ref"), "--out", str(ref), *common)
    p = torchrun(
        "--dir",
        str(tmp_path / "ck-run"),
        "--out",
        str(run),
        "--kill-rank",
        "0",
        "--kill-at",
        "10",
        "--kill-point",
        "after-backward",
        *common,
        restarts=1,
    )
    assert (run / "killed").read_text() == "10 after-backward", p.stderr[-3000:]
    starts = sorted(int(f.read_text().split()[0]) for f in run.glob("start-rank*.txt"))
    assert len(starts) == 4 and starts[2] == starts[3] and 6 <= starts[2] <= 10
    assert all(fired == n and n > 0 for fired, n in _clipped(run))
    for r in (0, 1):
        want, got = _load(ref / f"final-rank{r}.pt"), _load(run / f"final-rank{r}.pt")
        assert diff_states(want, got) == []


def attempts(run: Path, rank: int) -> tuple[list[str], list[tuple[int, ...]]]:
    """Rank ``rank``'s attempts under torchrun, oldest first: where each resumed
    (``"step source"``) and (its checkpointing process's pid, the pid it took over or -1)."""
    found = sorted(
        (p.stat().st_mtime_ns, p.read_text(), run / p.name.replace("start", "process"))
        for p in run.glob(f"start-rank{rank}-*.txt")
    )
    return [a[1] for a in found], [tuple(map(int, a[2].read_text().split())) for a in found]


def test_elastic_restarts_take_over_the_surviving_writers(torchrun, tmp_path):
    """``torchrun --max-restarts 2``: rank 1 SIGKILLed before step 4, later an exception
    in rank 0 at step 8. Each restarted rank recovers from disk every step its writer was
    sent, takes that writer over (one writer per rank for the whole job), and the job
    ends bit-identical to an uninterrupted run."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d in (ref, run):
        d.mkdir()
    common = ("--steps", "12", "--full-every", "5", "--batch-size", "2")
    torchrun("--dir", str(tmp_path / "ck-ref"), "--out", str(ref), *common)
    torchrun(
        "--dir", str(tmp_path / "ck"), "--out", str(run), *common,
        "--kill-rank", "1", "--kill-at", "4", "--raise-rank", "0", "--raise-at", "8",
        restarts=2,
    )  # fmt: skip
    assert (run / "killed").read_text() == "4 before-forward"
    assert (run / "raised").read_text() == "8"
    for r in (0, 1):
        starts, pids = attempts(run, r)
        assert [a.split()[0] for a in starts] == ["0", "4", "8"]
        first = pids[0][0]
        assert pids == [(first, -1), (first, first), (first, first)], pids
        want, got = _load(ref / f"final-rank{r}.pt"), _load(run / f"final-rank{r}.pt")
        assert diff_states(want, got) == []
