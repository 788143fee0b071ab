"""A user's own loop under lowdiff.attach with torchdata's StatefulDataLoader: SIGKILL the
real process, resume, and get the uninterrupted run's batches and final state bit for bit."""

from __future__ import annotations

import pytest
from tests.integrations.harness import kill_resume_compare

pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.parametrize("kill_after", [17])
def test_loop_with_stateful_loader_resumes_bit_exactly(tmp_path, kill_after):
    # 200 samples / 16 per batch = 13 batches per epoch: the kill lands in the second epoch
    start, ref = kill_resume_compare(
        tmp_path, "attach_loop.py", ["--steps", "30"], kill_after=kill_after
    )
    assert start >= kill_after - 1
    assert len(ref) == 30
