"""lowdiff_lab.prefork: a forked child is what ``python ARGS`` would have been."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests import launch

from lowdiff_lab.prefork import PreforkServer


def test_argv_exit_code_traceback_and_kill(tmp_path) -> None:
    s = launch.server()
    code = "import sys; print(sys.argv, __name__); sys.exit(3)"
    r = s.run([sys.executable, "-c", code, "a"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and r.stdout == "['-c', 'a'] __main__\n"
    script = tmp_path / "boom.py"
    script.write_text("raise ValueError('boom')\n")
    r = s.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == "ValueError: boom"
    assert "prefork" not in r.stderr  # the interpreter's traceback, not the server's frames
    p = s.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert p.forked and p.stdout is not None and p.stdout.readline() == "up\n"
    assert os.getpgid(p.pid) == p.pid  # a session of its own
    p.kill()
    assert p.wait(30) == -signal.SIGKILL


def test_what_a_fork_cannot_be_starts_a_new_interpreter() -> None:
    with PreforkServer() as s:
        env = dict(os.environ, PYTHONHASHSEED="123")
        p = s.popen([sys.executable, "-c", "pass"], env=env)
        assert not p.forked and p.wait(60) == 0
        p = s.popen([sys.executable, "-c", "pass"])
        assert p.forked and p.wait(60) == 0
