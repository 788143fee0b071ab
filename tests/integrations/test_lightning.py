"""Lightning with lowdiff.integrations.lightning.LowDiffCallback and a StatefulDataLoader:
SIGKILL the real process in the second epoch, run it again (it resumes by itself), and get
the uninterrupted run's batches, losses and final state (model, optimizer, scheduler, RNG,
global step, epoch, data position) bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from tests.integrations.harness import kill_resume_compare

pytest.importorskip("lightning", reason="lightning is not installed")
pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.parametrize("kill_after", [14, 17])
def test_lightning_resumes_bit_exactly_after_sigkill(tmp_path, kill_after):
    # 200 samples / 16 per batch = 13 batches per epoch: killed after step 14 it resumes
    # at the end of the first epoch (step 13) or just after; after 17, inside the second
    start, ref = kill_resume_compare(
        tmp_path, "lightning_train.py", ["--steps", "30"], kill_after=kill_after
    )
    assert start >= kill_after - 1
    assert len(ref) == 30


@pytest.mark.parametrize("plateau", [False, True])
def test_lightning_max_epochs_resumes_at_an_epoch_end_bit_exactly(tmp_path, plateau):
    """max_epochs (no max_steps): killed after step 14, the run resumes at step 13, the
    end of the first epoch, and the second epoch sees the uninterrupted run's batches (the
    loader's saved state is loaded, though Lightning counts the epoch as finished). With
    a validation at each epoch's end (and ReduceLROnPlateau on its loss), the resumed
    run goes on from the RNG states after that validation."""
    args = ["--epochs", "3"] + (["--plateau"] if plateau else [])
    start, ref = kill_resume_compare(tmp_path, "lightning_train.py", args, kill_after=14, sleep=0.3)
    assert start == 13 and ref[13][-1] == "0" and ref[14][-1] == "1"  # the epoch's end
    assert sorted(ref) == list(range(1, 40))  # 3 epochs of 13 steps
    if plateau:
        from tests.integrations.harness import reference_run, steps

        assert 13 in steps(reference_run("lightning_train.py", args)[0], "eval")


@pytest.mark.parametrize("kill_after", [9, 14])
def test_lightning_reduce_lr_on_plateau_resumes_bit_exactly(tmp_path, kill_after):
    """ReduceLROnPlateau on the validation loss, stepped at each epoch's end: resumed in
    the middle of the first epoch (step 8) or at its end (step 13), the plateau steps at
    the ends of the resumed run's epochs are the uninterrupted run's."""
    import json

    from tests.integrations.harness import reference_run, steps

    args = ["--steps", "30", "--plateau"]
    start, ref = kill_resume_compare(
        tmp_path, "lightning_train.py", args, kill_after=kill_after, sleep=0.3
    )
    assert start == kill_after - 1
    lines, ref_state = reference_run("lightning_train.py", args)
    assert {13, 26} <= set(steps(lines, "eval"))  # a validation at each epoch's end
    sched = json.loads(
        bytes(safetensors.torch.load_file(str(ref_state))["scheduler.json"].tolist())
    )
    assert sched["last_epoch"] == 2  # the plateau stepped at both, as in the resumed run


@pytest.mark.timeout(600)
def test_lightning_ddp_resumes_mid_epoch_bit_exactly(tmp_path):
    """Two CPU ranks under Lightning's DDP strategy (gloo): every rank exits after step 17,
    in the middle of the third epoch (7 batches per rank and epoch: steps 15 to 21), and
    the run started again resumes there and ends bit-identical to an uninterrupted one,
    with the same batches. Lightning puts a DistributedSampler in; its order depends on
    the epoch, which must be set before the loader fast-forwards to the saved position."""
    from tests.integrations.harness import diff_files, resumed_at, run, steps

    args = ["--steps", "30", "--devices", "2"]
    ref_lines, _ = run("lightning_train.py", [*args, "--dir", str(tmp_path / "ref"),
                                              "--dump", str(tmp_path / "ref.st")], timeout=300)  # fmt: skip
    ck = str(tmp_path / "ck")
    first, _ = run("lightning_train.py", [*args, "--dir", ck, "--exit-after", "17"], timeout=300)
    ref = steps(ref_lines)
    assert max(steps(first)) == 17
    assert ref[17][-1] == ref[18][-1] == "2" and ref[14][-1] == "1"  # mid-epoch
    lines, _ = run("lightning_train.py", [*args, "--dir", ck, "--dump",
                                          str(tmp_path / "resumed.st")], timeout=300)  # fmt: skip
    assert resumed_at(lines) == 17
    got = steps(lines)
    assert min(got) == 18 and max(got) == 30
    assert got == {s: ref[s] for s in got}  # losses and batches, step by step
    assert diff_files(tmp_path / "ref.st", tmp_path / "resumed.st") == []


def _after_last_resume(text: str) -> list[str]:
    lines = text.splitlines()
    last = max(i for i, ln in enumerate(lines) if ln.startswith("resumed "))
    return lines[last:]


@pytest.mark.timeout(300)
def test_lightning_fsdp2_resumes_bit_exactly_after_sigkill(torchrun, tmp_path):
    """FSDP2 through Lightning's ``ModelParallelStrategy`` (``fully_shard`` in
    ``configure_model``), LowDiff+, 2 gloo ranks under torchrun: rank 1 SIGKILLs itself
    after step 9, torchrun restarts the job, which resumes at a step no older than the one
    durable at the kill and ends with every rank's shard of the model and AdamW state, the
    scheduler, RNG, global step, epoch and data position bit-identical to an uninterrupted
    run, with the same losses and batches from the step it resumed at."""
    from tests.integrations.harness import EXAMPLES, diff_files, resumed_at, steps

    script = EXAMPLES / "lightning_train.py"
    args = ["--steps", "12", "--devices", "2", "--fsdp2"]
    ref = torchrun(*args, "--dir", str(tmp_path / "ref"), "--dump", str(tmp_path / "ref.st"),
                   script=script)  # fmt: skip
    killed = torchrun(*args, "--dir", str(tmp_path / "ck"), "--dump", str(tmp_path / "got.st"),
                      "--kill-rank", "1", "--kill-after", "9", restarts=1, script=script)  # fmt: skip
    kills = [ln.split() for ln in killed.stdout.splitlines() if ln.startswith("kill rank")]
    # the kill landed on the first attempt (a first attempt that failed before it would be
    # restarted without one)
    assert len(kills) == 1, (killed.stdout[-3000:], killed.stderr[-6000:])
    kill = kills[0]
    assert kill[:6] == ["kill", "rank", "1", "after", "step", "9"], kill
    durable_at_kill = int(kill[-1])
    resumed = _after_last_resume(killed.stdout)
    start = resumed_at(resumed)
    # rank 1 died between two updates, with step 9 not handed over yet: its replica holds
    # step 8. Rank 0's callback leaves its replica in memory on the error rank 1's death
    # raised, but rank 0 hands step 9 over when update 10 begins (or on torchrun's
    # SIGTERM): the replicas are then a step apart and the job resumes from disk (from
    # both replicas only when rank 0 stopped before that)
    assert resumed[0].split()[-1] in ("disk", "memory"), resumed[0]
    assert 0 <= durable_at_kill <= start <= 9, (durable_at_kill, start)
    want, got = steps(ref.stdout.splitlines()), steps(resumed)
    assert sorted(got) == list(range(start + 1, 13))
    assert got == {s: want[s] for s in got}  # losses and batches, step by step
    for r in (0, 1):
        a, b = tmp_path / f"ref.st.rank{r}", tmp_path / f"got.st.rank{r}"
        assert diff_files(a, b) == [], r
    # each rank holds half the rows of the first layer (fully_shard's dim-0 shards)
    assert safetensors.torch.load_file(str(tmp_path / "got.st.rank1"))[
        "model/net.0.weight"
    ].shape == (32, 16)


DDP_JOB = Path(__file__).with_name("lightning_ddp_job.py")
"""Lightning's DDP strategy with LowDiff+ on 2 gloo ranks, run under torchrun."""


@pytest.fixture(scope="module")
def ddp_plus_reference(torchrun, tmp_path_factory) -> Path:
    """The uninterrupted run of :data:`DDP_JOB` (final states ``final-rank{r}.pt``)."""
    base = tmp_path_factory.mktemp("lightning-ddp-plus-ref")
    out = base / "out"
    out.mkdir()
    torchrun("--dir", str(base / "ck"), "--out", str(out), script=DDP_JOB)
    assert sorted(f.read_text() for f in out.glob("start-rank*.txt")) == ["0 fresh", "0 fresh"]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fail", ["kill", "raise"])
def test_lightning_ddp_plus_resumes_from_the_replicas_in_memory_after_a_rank_fails(
    torchrun, tmp_path, ddp_plus_reference, fail
):
    """Lightning's DDP strategy, LowDiff+, 2 gloo ranks under ``torchrun --max-restarts 1``:
    rank 1 fails inside update 7's forward pass (SIGKILL, or an exception), after every
    rank handed step 6 to its replica. Rank 0 fails on the collective of that update's
    backward pass and Lightning calls ``on_exception``: its callback leaves its replica in
    memory instead of closing it (a rank that raised lets go of its replica the same way).
    The restarted job finds both replicas at step 6, rebuilds every rank's state from them
    (``source == "memory"``) and ends bit-identical to an uninterrupted run."""
    from lowdiff.state.capture import diff_states

    run = tmp_path / "run"
    run.mkdir()
    torchrun("--dir", str(tmp_path / "ck"), "--out", str(run), "--fail-rank", "1",
             "--fail-at", "7", "--fail", fail, script=DDP_JOB, restarts=1)  # fmt: skip
    assert (run / "failed").read_text() == f"6 {fail}"  # the failure landed in update 7
    starts = {f.name: f.read_text() for f in run.glob("start-rank*.txt")}
    assert starts == {
        "start-rank0-attempt0.txt": "0 fresh",
        "start-rank1-attempt0.txt": "0 fresh",
        "start-rank0-attempt1.txt": "6 memory",
        "start-rank1-attempt1.txt": "6 memory",
    }
    for r in (0, 1):
        want = torch.load(ddp_plus_reference / f"final-rank{r}.pt", weights_only=True)
        got = torch.load(run / f"final-rank{r}.pt", weights_only=True)
        assert diff_states(want, got) == [], r
        assert int(got["trainer.global_step"]) == 12
