"""Lightning with lowdiff.integrations.lightning.LowDiffCallback and a StatefulDataLoader:
SIGKILL the real process in the second epoch, run it again (it resumes by itself), and get
the uninterrupted run's batches, losses and final state (model, optimizer, scheduler, RNG,
global step, epoch, data position) bit for bit."""

from __future__ import annotations

import pytest
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
