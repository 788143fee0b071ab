"""The README's attach loop counts optimizer updates: with a GradScaler that skips some
of them, a run SIGKILLed and resumed ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests import launch
from tests.integrations.harness import _env

pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")

pytestmark = [pytest.mark.multiprocess]

SCRIPT = Path(__file__).with_name("scaler_skip_loop.py")


def _run(directory: Path, kill_at: int, out: Path) -> subprocess.CompletedProcess[str]:
    return launch.run(
        [sys.executable, str(SCRIPT), str(directory), "20", str(kill_at), str(out)],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip


def test_skipped_updates_do_not_shift_a_resumed_loop(tmp_path: Path) -> None:
    ref = _run(tmp_path / "ref", -1, tmp_path / "ref.json")
    assert ref.returncode == 0, ref.stderr
    killed = _run(tmp_path / "ck", 12, tmp_path / "unused.json")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # the condition happened: the scaler skipped an update before the kill
    assert json.loads(killed.stdout.splitlines()[-1])["skipped"] >= 1
    resumed = _run(tmp_path / "ck", -1, tmp_path / "resumed.json")
    assert resumed.returncode == 0, resumed.stderr
    want, got = (json.loads((tmp_path / n).read_text()) for n in ("ref.json", "resumed.json"))
    assert got["resumed"] > 0 and want["skipped"] >= 1
    for key in ("state", "scheduler", "scaler", "loader"):
        assert got[key] == want[key], key
