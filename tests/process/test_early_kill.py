"""A trainer SIGKILLed right after its first steps in a new directory, while its
checkpointing process may still be starting: the next trainer reaches every step whose
``ck.step()`` returned, bit-identical (the process takes the staged step-0 state from
the living trainer before the first step returns)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests import launch
from tests.process import early_kill_script as job

import lowdiff
from lowdiff.state.capture import diff_states, snapshot_state

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(job.__file__)


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
@pytest.mark.parametrize("n_steps", [1, 3])
def test_a_trainer_killed_in_its_first_steps_loses_none_of_them(
    tmp_path: Path, strategy: str, n_steps: int
) -> None:
    d = tmp_path / "ck"
    args = [sys.executable, str(SCRIPT), str(d), strategy, str(n_steps), "kill"]
    first = launch.run(args, stdout=subprocess.PIPE, text=True, env=launch.env(), timeout=120)
    assert first.returncode == -signal.SIGKILL
    # killed right after them, none of them durable yet: recovery needs what the
    # trainer handed over before it died
    said = first.stdout.split()
    assert said[:2] == ["acknowledged", str(n_steps)] and int(said[3]) < n_steps, said
    # the same steps without a crash (LowDiff: the same compression, nothing written)
    model, opt = job.build()
    if strategy == "lowdiff":
        with lowdiff.Checkpointer(
            None,
            model,
            opt,
            method="compression-only",
            compressor=lowdiff.TopK(0.5, error_feedback=False),
        ) as plain:
            for t in range(n_steps):
                job.train_step(model, plain, t)
    else:
        for t in range(n_steps):
            g = torch.Generator().manual_seed(t)
            model(torch.randn(4, 8, generator=g)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    want = snapshot_state(model, opt, None)
    ck = job.checkpointer(str(d), strategy)
    try:
        assert ck.resume() == n_steps
        assert diff_states(snapshot_state(ck.model, ck.optimizer, None), want) == []
    finally:
        ck.close()
