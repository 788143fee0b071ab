"""The supervisor takes a killed trainer's last lines without waiting for the end of its
stdout, which a process it started may hold open long after it died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lowdiff_lab.chaos.supervisor import _Stdout

N = 400

CHILD = f"""
import subprocess, sys, time
holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(holder.pid, flush=True)
for i in range({N}):
    sys.stdout.write('{{"event": "step", "step": %d, "pad": "%s"}}\\n' % (i, "x" * 200))
sys.stdout.flush()
time.sleep(120)
"""


def test_the_lines_of_a_killed_process_are_taken_while_another_holds_its_stdout(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    out = _Stdout(child.stdout, tmp_path / "stdout.jsonl")
    holder = None
    try:
        first = out.lines.get(timeout=60)
        assert first is not None
        holder = int(first[1])
        # let the child write every line (most stay unread in the pipe or in flight)
        deadline = time.monotonic() + 60
        while out.lines.qsize() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        out.settle(timeout=30)
        # the holder still has the pipe: the stream has not ended, yet every line is in
        assert not out._eof.is_set()
        got = []
        while not out.lines.empty():
            item = out.lines.get_nowait()
            assert item is not None
            got.append(item[1])
        assert len(got) == N
        assert got[-1].startswith(f'{{"event": "step", "step": {N - 1},')
        assert (tmp_path / "stdout.jsonl").read_text().count("\n") == N + 1
    finally:
        if holder is not None:
            os.kill(holder, signal.SIGKILL)
        if child.poll() is None:
            child.kill()
    assert out.lines.get(timeout=30) is None  # the end, once the holder is gone
