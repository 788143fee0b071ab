"""Run an example script as a real process, SIGKILL it mid-run, resume it, and compare
its final state with an uninterrupted run."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import safetensors.torch
from tests import launch

import lowdiff
from lowdiff.state.capture import diff_states

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(lowdiff.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def run(
    script: str,
    args: list[str],
    kill_after: int | None = None,
    timeout: float = 120,
    stderr: list[str] | None = None,
) -> tuple[list[str], int]:
    """Run ``examples/<script>``; with ``kill_after``, SIGKILL it once it printed that step.

    Returns its stdout lines and the last step it printed; its stderr is appended to
    ``stderr`` when given.
    """
    proc = launch.popen(
        [sys.executable, str(EXAMPLES / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=str(EXAMPLES.parent),
    )
    lines: list[str] = []
    reported = 0
    err = ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("step "):
                reported = int(line.split()[1])
                if kill_after is not None and reported >= kill_after:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        proc.wait(timeout=timeout)
        assert proc.stderr is not None
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if stderr is not None:
        stderr.append(err)
    if kill_after is None:
        assert proc.returncode == 0, (lines[-5:], err[-3000:])
    else:
        assert proc.returncode == -signal.SIGKILL, (lines[-5:], err[-3000:])
    return lines, reported


def steps(lines: list[str], kind: str = "step") -> dict[int, list[str]]:
    """``step N a b ...`` lines (or another ``kind``: ``eval N ...``) as ``{N: [a, b, ...]}``."""
    return {int(p[1]): p[2:] for p in (ln.split() for ln in lines) if p and p[0] == kind}


def resumed_at(lines: list[str]) -> int:
    return next(int(ln.split()[1]) for ln in lines if ln.startswith("resumed "))


def diff_files(a: Path, b: Path) -> list[str]:
    return diff_states(safetensors.torch.load_file(str(a)), safetensors.torch.load_file(str(b)))


_REFERENCES: dict[tuple[str, ...], tuple[list[str], Path]] = {}


def reference_run(script: str, args: list[str]) -> tuple[list[str], Path]:
    """The uninterrupted run of ``script`` with ``args``: its stdout lines and its final
    state's file. Run once per test session: the tests that kill the same run at different
    steps compare with the same reference."""
    key = (script, *args)
    if key not in _REFERENCES:
        d = Path(tempfile.mkdtemp(prefix="lowdiff-ref-"))
        atexit.register(shutil.rmtree, d, ignore_errors=True)
        lines, _ = run(script, [*args, "--dir", str(d / "ck"), "--dump", str(d / "ref.st")])
        _REFERENCES[key] = (lines, d / "ref.st")
    return _REFERENCES[key]


def kill_resume_compare(
    tmp_path: Path,
    script: str,
    args: list[str],
    kill_after: int,
    resumed_stderr: list[str] | None = None,
    sleep: float = 0.05,
) -> tuple[int, dict[int, list[str]]]:
    """The whole check: uninterrupted run, killed run, resumed run; the final states must be
    bit-identical and every step (and evaluation) the resumed run printed must match the
    reference's line.

    The killed run sleeps ``sleep`` seconds after printing each step: the kill lands
    there, before the next update hands the step over, so the run resumes at the step
    before ``kill_after`` (a longer sleep makes that surer).

    Returns the step the resumed run started from and the reference's step lines; the
    resumed run's stderr is appended to ``resumed_stderr`` when given.
    """
    ref_lines, ref_state = reference_run(script, args)
    ck = str(tmp_path / "ck")
    _, reported = run(script, [*args, "--dir", ck, "--sleep", str(sleep)], kill_after=kill_after)
    lines, _ = run(
        script, [*args, "--dir", ck, "--dump", str(tmp_path / "resumed.st")], stderr=resumed_stderr
    )
    start = resumed_at(lines)
    assert 0 < start <= reported + 1, (start, reported)
    ref, got = steps(ref_lines), steps(lines)
    assert got, lines[-5:]
    assert min(got) == start + 1
    assert {s: got[s] for s in got} == {s: ref[s] for s in got}
    ref_evals, got_evals = steps(ref_lines, "eval"), steps(lines, "eval")
    assert got_evals == {s: v for s, v in ref_evals.items() if s > start}
    diff = diff_files(ref_state, tmp_path / "resumed.st")
    assert diff == [], diff
    return start, ref
