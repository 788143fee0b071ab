"""transformers.Trainer with lowdiff.integrations.hf.LowDiffCallback: SIGKILL the real
process mid-epoch, resume through the callback's resume point, and get the uninterrupted
run's steps, epochs and final state (model, optimizer, scheduler, RNG, global step) bit
for bit."""

from __future__ import annotations

import pytest
from tests.integrations.harness import kill_resume_compare

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip(
    "accelerate", reason="accelerate (needed by transformers.Trainer) is not installed"
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_trainer_resumes_bit_exactly_after_sigkill(tmp_path):
    # 100 samples, batches of 8, 2 accumulation steps: 7 updates per epoch; the kill lands
    # inside the second epoch, so the Trainer skips batches on resume
    err: list[str] = []
    start, ref = kill_resume_compare(
        tmp_path, "hf_trainer.py", ["--steps", "20"], kill_after=9, resumed_stderr=err
    )
    assert start % 7 != 0
    assert len(ref) == 20
    # the resume point's weights hold every key, tied ones included: the Trainer, which
    # loads them before lowdiff restores the model, has no missing key to warn about
    assert "missing keys" not in err[0], err[0][-3000:]
