"""SIGTERM, as a scheduler sends it before it reclaims a node: make every acknowledged
step durable, then end as SIGTERM would have.

A strategy registers itself (:func:`register`, with ``sigterm_timeout`` seconds); the
first registration installs the handler in the main thread. A SIGTERM handler the process
set before is kept, not replaced: lowdiff's runs first and then hands the signal on to it
(a handler installed outside Python, which cannot be called from here, is left alone, and
lowdiff does not handle SIGTERM in that process). On SIGTERM every registered strategy
makes the steps it acknowledged durable on its own (no collective: under DDP each rank
flushes its shard), within the timeout; then the process goes on the way it would have
without lowdiff: with the handler found at installation (a callable is called with the
signal and the frame; ``SIG_DFL`` ends the process by SIGTERM, so its exit status says so;
``SIG_IGN`` lets it go on). A process that goes on (its handler returned, or SIGTERM is
ignored) handles the next SIGTERM the same way.

The handler runs between two bytecodes of the main thread, which may be in the middle of
lowdiff's own talk with a checkpointing process (a message half sent, a reply half read,
a hand-over half done). Those sections are marked (:func:`busy`); a SIGTERM that arrives
inside one is handled when the last of them ends, in the thread that ends it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

_active: list[int] = []
"""One entry per marked section in progress, in any thread (list operations are atomic)."""
_pending: list[int] = []
"""Non-empty while a SIGTERM waits for the sections in progress to end."""
_registered: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
_previous: Any = None
_installed = False
_lock = threading.Lock()


class Preemptible(Protocol):
    def preempt(self, deadline: float) -> None:
        """Make every acknowledged step durable by ``deadline`` (``time.monotonic()``)."""


def register(strategy: Preemptible, timeout: float) -> bool:
    """Handle SIGTERM for ``strategy``; False when lowdiff does not handle SIGTERM in this
    process (not called from the main thread, or SIGTERM has a handler installed outside
    Python)."""
    global _installed, _previous
    with _lock:
        if not _installed:
            if threading.current_thread() is not threading.main_thread():
                return False
            current = signal.getsignal(signal.SIGTERM)
            if current is None:
                return False  # a handler set outside Python: it cannot be handed the signal
            _previous = current  # the process's own handler runs after lowdiff's
            signal.signal(signal.SIGTERM, _handler)
            _installed = True
        _registered[strategy] = timeout
        return True


def unregister(strategy: Preemptible) -> None:
    _registered.pop(strategy, None)


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Mark lowdiff's own talk with a checkpointing process (see the module docstring)."""
    _active.append(1)
    try:
        yield
    finally:
        _active.pop()
        if _pending and not _active:
            _preempt()


def _handler(signum: int, frame: Any) -> None:
    if _active:
        _pending.append(1)
        _frame[:] = [frame]
        return
    _preempt(frame)


_running: list[int] = []
_frame: list[Any] = []
"""The frame a deferred SIGTERM arrived in (handed to the process's own handler)."""


def _preempt(frame: Any = None) -> None:
    _pending.clear()
    if frame is None and _frame:
        frame = _frame.pop()
    _frame.clear()
    if _running:
        return  # a second SIGTERM while the first is handled
    _running.append(1)
    try:
        waiting = list(_registered.items())
        deadline = time.monotonic() + max((t for _, t in waiting), default=0.0)
        for strategy, _ in waiting:
            try:
                strategy.preempt(deadline)
            except Exception as e:  # noqa: BLE001 -- said, then the exit goes on
                # the process is about to end: a line on standard error is all that is
                # left to tell which steps may not be durable
                with contextlib.suppress(Exception):
                    sys.stderr.write(
                        "lowdiff: on SIGTERM, the steps acknowledged since the last durable "
                        f"one were not all made durable: {e}\n"
                    )
                    sys.stderr.flush()
        previous = _previous
        if callable(previous):
            previous(signal.SIGTERM, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # the default action ends the process; nothing runs after it
    finally:
        _running.clear()  # a process that goes on handles the next SIGTERM again
