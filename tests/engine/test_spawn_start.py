"""How background processes start.

With the fork server started as a fork of the trainer (the default), a new process does
not run the main script again, so a training script without a ``__main__`` guard works.
With ``LOWDIFF_PROCESS_START=interpreter`` (a new interpreter, as ``spawn``) such a script,
or one piped into ``python -``, gets an error that names the cause instead of a bare exit
code, and nothing trains in the new process."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tests import launch

import lowdiff
from lowdiff.errors import LowDiffError
from lowdiff.proc import spawn

SCRIPT = textwrap.dedent(
    """
    import sys, torch, lowdiff
    strategy, directory = sys.argv[1], sys.argv[2]
    print("MAIN RAN", flush=True)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"compressor": lowdiff.TopK(0.5)} if strategy == "lowdiff" else {}
    ck = lowdiff.Checkpointer(model, opt, directory, strategy=strategy, **kw)
    start = ck.resume()
    for _ in range(start, 3):
        model(torch.ones(2, 4)).sum().backward()
        ck.step()
        opt.zero_grad()
    ck.close()
    print("TRAINED", flush=True)
    """
)

GUARDED = (
    "def main():\n" + textwrap.indent(SCRIPT, "    ") + '\nif __name__ == "__main__":\n    main()\n'
)


def _run(
    args: list[str], stdin: str | None = None, start: str = "fork"
) -> subprocess.CompletedProcess[str]:
    env = dict(launch.env(), LOWDIFF_PROCESS_START=start)
    if stdin is not None:  # a script piped into a new interpreter
        return subprocess.run(
            [sys.executable, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
    # the trainer is a fork of the tests' warm Python; what is checked is how *its*
    # processes start (a fork of it, or with "interpreter" a new interpreter each)
    return launch.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=env)


STRATEGIES = ["lowdiff", "lowdiff+", "checkfreq", "naive-dc", "gemini"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_script_without_main_guard_trains_with_the_forked_server(
    tmp_path: Path, strategy: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = _run([str(script), strategy, str(tmp_path / "ck")])
    assert r.returncode == 0, r.stdout + r.stderr
    # the script ran once: the new processes are forks that hold its main module already
    assert r.stdout.count("MAIN RAN") == 1 and "TRAINED" in r.stdout, r.stdout


@pytest.mark.multiprocess
# every background process starts through proc.link (one path): lowdiff's two engines and
# one baseline stand for the rest under the interpreter start
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+", "gemini"])
def test_script_without_main_guard_fails_with_the_cause(tmp_path: Path, strategy: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ckdir = tmp_path / "ck"
    r = _run([str(script), strategy, str(ckdir)], start="interpreter")
    assert r.returncode != 0, r.stdout + r.stderr
    # the script ran twice: in the trainer and again in the spawned process
    assert r.stdout.count("MAIN RAN") == 2, r.stdout
    assert "TRAINED" not in r.stdout
    # the spawned process stopped at its Checkpointer, naming the guard ...
    assert "was created while a new process started by spawn" in r.stderr, r.stderr
    # ... and the trainer's error says the process died while starting, and why
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("lowdiff.errors.CheckpointWorkerError"), last
    assert "while starting, before it was ready" in last and '__name__ == "__main__"' in last
    assert str(script) in last

    if strategy not in ("lowdiff", "lowdiff+"):
        return  # the baselines' guarded runs are their own tests
    # with the guard, the same script trains in the same directory
    script.write_text(GUARDED)
    r = _run([str(script), strategy, str(ckdir)], start="interpreter")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("MAIN RAN") == 1 and "TRAINED" in r.stdout


@pytest.mark.multiprocess
def test_script_piped_into_python_is_refused_before_anything_starts(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    r = _run(["-", "lowdiff", str(ckdir)], stdin=SCRIPT)
    assert r.returncode != 0
    assert r.stdout.count("MAIN RAN") == 1  # no process re-ran it
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("lowdiff.errors.LowDiffError"), last
    assert "<stdin>' is not a file" in last
    # python -c runs no file again: the same script works there
    r = _run(["-c", SCRIPT, "lowdiff", str(tmp_path / "ck2")])
    assert r.returncode == 0, r.stderr
    assert "TRAINED" in r.stdout


def test_refuse_in_bootstrap_only_while_spawn_runs_the_main_script(monkeypatch) -> None:
    spawn.refuse_in_bootstrap("x")  # the test process: not bootstrapping
    monkeypatch.setattr(mp.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(LowDiffError, match="__main__"):
        spawn.refuse_in_bootstrap("x")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(LowDiffError, match="lowdiff.Checkpointer was created"):
        lowdiff.Checkpointer(
            None,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            compressor=lowdiff.TopK(ratio=0.01),
        )


def test_spawn_context_checks_the_main_script(monkeypatch, tmp_path: Path) -> None:
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", None, raising=False)
    monkeypatch.setattr(main, "__file__", str(tmp_path / "gone.py"), raising=False)
    with pytest.raises(LowDiffError, match="gone.py' is not a file"):
        spawn.spawn_context()
    real = tmp_path / "train.py"
    real.write_text("")
    monkeypatch.setattr(main, "__file__", str(real))
    assert spawn.spawn_context().get_start_method() == "spawn"
    assert str(real) in spawn.guard_hint()
    monkeypatch.delattr(main, "__file__")  # python -c, a notebook
    assert spawn.spawn_context().get_start_method() == "spawn"


@pytest.mark.parametrize("start", ["fork", "interpreter"])
def test_a_process_that_dies_while_starting_is_described_by_how_it_died(
    monkeypatch: pytest.MonkeyPatch, start: str
) -> None:
    from types import SimpleNamespace

    from lowdiff.proc import server
    from lowdiff.proc.spawn import exit_message

    monkeypatch.setenv(server.ENV, start)
    killed = exit_message("the process", SimpleNamespace(pid=7, exitcode=-9), ready=False)
    assert killed.startswith("the process (pid 7) was killed by SIGKILL while starting")
    assert "__main__" not in killed  # a signal is no script error
    failed = exit_message("the process", SimpleNamespace(pid=7, exitcode=1), ready=False)
    assert "exited with code 1 while starting" in failed
    # only a process started as a new interpreter ran the main script again
    assert ('__name__ == "__main__"' in failed) == (start == "interpreter")
