"""Small pieces the harness commands (demo, bench, chaos, torture) share: units, the
progress display, child processes, SIGTERM.

The standard library and tqdm only (no torch), so that importing it costs little.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

from lowdiff.cli.args import fmt_bytes

__all__ = ["fmt_bytes"]  # the library's, shared with the lab's reports


class Progress:
    """The progress display of a harness command, on stderr, built on tqdm.

    - A status message (``progress("...")``): on a terminal, one line that tqdm rewrites
      in place, prefixed with the seconds since the display was made. Elsewhere (a pipe,
      a log file, a test capturing stderr) tqdm's redraws would be unreadable, so each
      message is a line of its own with the same prefix.
    - With ``total``: a bar of steps done out of ``total`` (on a terminal; elsewhere the
      messages alone), the newest message as its description; :meth:`advance` moves it
      and :meth:`grow` raises the total.
    - A line (:meth:`write`): printed as it is, above the status line on a terminal.
    - Quiet: nothing at all.

    :meth:`close` clears the status line (a bar stays, finished); as a context manager
    it closes at the end, keeping the line when an exception ends the block.

    Example:
        >>> with Progress(quiet=False) as progress:  # doctest: +SKIP
        ...     progress("job 1: step 25/100")
        ...     progress.write("job 1: done")
    """

    def __init__(
        self, quiet: bool = False, *, total: int | None = None, unit: str = "step"
    ) -> None:
        self.quiet = quiet
        self._file = sys.stderr
        self._tty = not quiet and self._file.isatty()
        self._t0 = time.monotonic()
        self._total = total
        self._bar: tqdm[Any] | None = None
        if self._tty and total is not None:
            self._bar = tqdm(total=total, unit=unit, file=self._file, dynamic_ncols=True)

    def _status_bar(self) -> tqdm[Any]:
        if self._bar is None:
            # made at the first message, so that a display of lines alone draws no bar
            self._bar = tqdm(
                total=None,
                bar_format="[{elapsed_s:6.0f} s] {desc}",
                file=self._file,
                dynamic_ncols=True,
                leave=False,
            )
        return self._bar

    def __call__(self, msg: str) -> None:
        """Show ``msg`` as the current status."""
        if self.quiet:
            return
        if not self._tty:
            self._file.write(f"[{time.monotonic() - self._t0:6.0f} s] {msg}\n")
            self._file.flush()
        elif self._total is None:
            self._status_bar().set_description_str(msg)
        else:
            assert self._bar is not None
            self._bar.set_description(msg)

    def write(self, line: str) -> None:
        """Print ``line`` as it is (above the status line on a terminal)."""
        if self.quiet:
            return
        tqdm.write(line, file=self._file)
        self._file.flush()

    def advance(self, n: int, **postfix: str) -> None:
        """Move the bar ``n`` steps on; ``postfix`` shows next to it (``loss="2.31"``)."""
        if self._bar is None or self._total is None or n <= 0:
            return
        self._bar.update(n)
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)

    def grow(self, n: int) -> None:
        """Raise the bar's total by ``n`` steps (work found on the way)."""
        if self._bar is None or self._total is None or n <= 0:
            return
        assert self._bar.total is not None
        self._bar.total += n
        self._bar.refresh()

    def close(self, keep: bool = False) -> None:
        """End the display: clear the status line (``keep``: leave it); a bar stays."""
        if self._bar is not None:
            self._bar.leave = keep or self._total is not None
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(keep=e is not None)


_printers: list[Progress] = []
"""The displays :func:`progress_printer` made that :func:`end_progress` has not closed."""


def progress_printer(quiet: bool) -> Callable[[str], None]:
    """A status callback: a :class:`Progress` without a total, ended by :func:`end_progress`."""
    progress = Progress(quiet)
    _printers.append(progress)
    return progress


def end_progress(quiet: bool) -> None:
    """End the displays of :func:`progress_printer` (on a terminal: clear the line).

    ``quiet`` is the flag the printer was made with (a quiet one showed nothing).
    """
    while _printers:
        _printers.pop().close()


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
    # slower in bursts, but it slows training itself, which makes every overhead look
    # smaller (the figures: docs/chaos.md). Neither changes how work is split, so results
    # stay bit-identical.
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
