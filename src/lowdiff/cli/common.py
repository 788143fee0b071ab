"""Small pieces the commands share: units, the progress line, child processes, SIGTERM.

Standard library only, so that importing it costs nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fmt_bytes(n: float | None) -> str:
    """``1536 -> "1.5 KiB"``; None -> ``"n/a"``."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def progress_printer(quiet: bool) -> Callable[[str], None]:
    """A progress callback: one line rewritten in place on a terminal, lines otherwise,
    each prefixed with the seconds since it was made."""
    t0 = time.monotonic()
    tty = sys.stderr.isatty()

    def progress(msg: str) -> None:
        if quiet:
            return
        line = f"[{time.monotonic() - t0:6.0f} s] {msg}"
        sys.stderr.write(("\r\033[K" + line[:150]) if tty else line + "\n")
        sys.stderr.flush()

    return progress


def end_progress(quiet: bool) -> None:
    """Clear the progress line of :func:`progress_printer` on a terminal."""
    if not quiet and sys.stderr.isatty():
        sys.stderr.write("\r\033[K")


def child_env(threads: int) -> dict[str, str]:
    """Environment of a training process: this lowdiff, pinned threads, no downloads."""
    import lowdiff

    env = dict(os.environ)
    # The child must import this very lowdiff, installed or not.
    src = str(Path(lowdiff.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # OpenMP's wait policy is left as the caller's environment has it: unset, idle threads
    # spin for a while at barriers, as in a user's own training, and every figure is
    # measured against that training. OMP_WAIT_POLICY=PASSIVE can steady the timings on
    # a shared machine, where a spinning thread whose sibling was descheduled makes steps
    # 5-10x slower in bursts (measured: ~1 s instead of ~160 ms), but it slows training
    # itself (on a quiet 2-core machine a compressed gpt2-demo step took 108 ms instead of
    # 67-69 ms), which makes every overhead look smaller. Neither changes how work is
    # split, so results stay bit-identical.
    env["PYTHONUNBUFFERED"] = "1"
    # Nothing may be downloaded at run time.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def sigterm_as_interrupt() -> Any:
    """Make SIGTERM raise KeyboardInterrupt, so that ``finally`` blocks stop the training
    processes (which live in sessions of their own); returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)
