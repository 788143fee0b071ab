"""Every snippet runs: the README's quickstart as a user copies it, the main snippet of
each guide, and every example in ``examples/``."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests import launch
from tests.docs.pages import DOCS, EXAMPLES, README, ROOT, readme_quickstart, section, snippet_after

from lowdiff.proc import holder

pytestmark = [pytest.mark.multiprocess]

GUIDES = DOCS / "guides"


def _env() -> dict[str, str]:
    env = launch.env()
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _lines_until(proc: subprocess.Popen[str], prefix: str) -> list[str]:
    """stdout lines of ``proc`` up to the first that starts with ``prefix``."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"no line {prefix!r} before the end: {seen[-5:]}")


def _started_at(lines: list[str]) -> int:
    starts = [int(m.group(1)) for ln in lines if (m := re.match(r"starting at step (\d+)", ln))]
    assert starts, lines[-5:]
    return starts[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_readme_quickstart_runs_as_written_and_resumes_after_kill_9(tmp_path):
    """The script in a fresh folder, in a new interpreter as a user runs it: killed with
    SIGKILL midway, run again (it goes on from where it stopped and finishes), then
    ``lowdiff inspect ckpt`` as the README says."""
    (tmp_path / "quickstart.py").write_text(readme_quickstart())
    run = section(README, "quickstart-run")
    assert "python quickstart.py" in run and "lowdiff inspect ckpt" in run

    first = subprocess.Popen(
        [sys.executable, "-u", "quickstart.py"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = _lines_until(first, "step 100,")
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait(timeout=60)
    assert _started_at(lines) == 0

    second = subprocess.run(
        [sys.executable, "quickstart.py"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout.splitlines()
    assert _started_at(out) >= 100  # every step whose ck.step() returned before the kill
    assert out[-1] == "step 300, durable up to step 300", out[-3:]

    inspect = subprocess.run(
        [sys.executable, "-m", "lowdiff", "inspect", "ckpt"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    assert "300" in inspect.stdout


def _needs(*modules: str) -> None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} is not installed (pip install -e '.[dev]')")


def _run(script: Path, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    r = launch.run(
        [sys.executable, str(script)],
        cwd=str(cwd), env=_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return r


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page,name,modules",
    [
        ("attach.md", "attach", ("torchdata",)),
        ("accelerate-deepspeed.md", "accelerate", ("accelerate",)),
        ("remote-storage.md", "remote", ("fsspec",)),
        ("tuning.md", "tuning", ()),
    ],
)
def test_a_guide_snippet_runs_and_resumes(tmp_path, page, name, modules):
    """The guide's main snippet, as written, twice in the same folder: the second run
    resumes what the first left."""
    _needs(*modules)
    script = tmp_path / f"{name}.py"
    script.write_text(snippet_after(GUIDES / page, name))
    _run(script, tmp_path)
    _run(script, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_export_snippet_runs_after_the_quickstart(tmp_path):
    (tmp_path / "quickstart.py").write_text(readme_quickstart())
    _run(tmp_path / "quickstart.py", tmp_path)
    script = tmp_path / "export.py"
    script.write_text(snippet_after(GUIDES / "export.md", "export"))
    out = _run(script, tmp_path).stdout.splitlines()
    assert out[0].startswith("step 300: ") and out[-1] == "280", out
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "step280.pt").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_preemption_snippet_survives_sigterm(tmp_path):
    """SIGTERM ends the trainer with SIGTERM's status once every acknowledged step is
    durable; the next run starts at the step it had reached."""
    (tmp_path / "train.py").write_text(snippet_after(GUIDES / "failures.md", "preemption"))
    before = _new_segments(set())
    starts = []
    for stop_after in (30, 1):
        p = subprocess.Popen(
            [sys.executable, "-u", "train.py"],
            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            starts.append(_started_at(_lines_until(p, "starting at step")))
            _lines_until(p, f"step {starts[-1] + stop_after}")
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=120) == -signal.SIGTERM
        finally:
            p.kill()
            p.wait(timeout=60)
    assert starts[0] == 0 and starts[1] >= 30, starts
    # the preempted trainer's checkpointing process waits for the next trainer (as it
    # should after a preemption): let it go, so that nothing outlives the test
    d = tmp_path / "ckpt"
    released = holder.release_orphan(d, 30.0)
    assert released is not None, "the preempted trainer's checkpointing process was not waiting"
    holder.forget_released(d, released)
    deadline = time.monotonic() + 30
    while _new_segments(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _new_segments(before)


def _new_segments(before: set[str]) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("lowdiff-")} - before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fsdp2_example_recovers_after_one_rank_is_killed(torchrun, tmp_path):
    """examples/fsdp2_train.py as its guide runs it: 2 ranks under torchrun, rank 1
    SIGKILLed, torchrun restarts the job and every rank resumes at one step."""
    pytest.importorskip("torch.distributed.fsdp", reason="needs torch.distributed")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)")
    p = torchrun(
        "--dir", str(tmp_path / "ck"), "--steps", "12", "--width", "32", "--depth", "2",
        "--full-every", "4", "--kill-rank", "1", "--kill-at", "7",
        restarts=1, script=EXAMPLES / "fsdp2_train.py",
    )  # fmt: skip
    assert "[rank 1] SIGKILL at step 7" in p.stdout
    assert "resumed 2 ranks at step" in p.stdout and "done: 12 steps" in p.stdout


def test_every_example_is_run_by_a_test():
    """Each example in examples/ is run somewhere in the test suite."""
    tests = [p.read_text() for p in (ROOT / "tests").rglob("test_*.py")]
    for example in sorted(EXAMPLES.glob("*.py")):
        assert any(example.name in t for t in tests), f"examples/{example.name} is run by no test"


def test_every_guide_shows_a_tested_snippet_or_an_example():
    """A guide's main snippet is run by this file, or the guide includes an example file
    that a test runs."""
    for page in sorted(GUIDES.glob("*.md")):
        text = page.read_text()
        tested = re.findall(r"<!-- tested: ([a-z0-9-]+) -->", text)
        included = re.findall(r'--8<-- "examples/([a-z0-9_]+\.py)"', text)
        assert tested or included, f"{page.name}: no tested snippet and no included example"
        for name in tested:
            assert f'"{name}"' in Path(__file__).read_text(), f"{page.name}: {name} runs nowhere"
