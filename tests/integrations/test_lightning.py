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
