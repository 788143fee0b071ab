"""DeepSpeed (ZeRO stage 0, CPU accelerator): lowdiff.attach on the torch optimizer that
deepspeed.initialize was given; engine.step() runs its step hooks once per update."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests.integrations.harness import _env

pytest.importorskip("deepspeed", reason="deepspeed is not installed")

pytestmark = [pytest.mark.multiprocess]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_attach_under_deepspeed_engine(tmp_path):
    job = Path(__file__).with_name("ds_job.py")
    out = subprocess.run(
        [sys.executable, str(job), str(tmp_path / "ck"), str(_free_port())],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert out.returncode == 0 and "ok" in out.stdout.split(), (
        out.stdout[-2000:],
        out.stderr[-4000:],
    )
