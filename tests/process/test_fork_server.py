"""The fork server is a fork of the trainer: Python's threads warning does not stop it."""

from __future__ import annotations

import os
import warnings

import pytest

from lowdiff.proc import server


def _forking_with(monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    """``os.fork`` warns as Python 3.12+ does in a process with several threads."""
    real = os.fork

    def fork() -> int:
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return real()

    monkeypatch.setattr(os, "fork", fork)


def test_the_threads_warning_of_a_fork_is_not_raised_where_warnings_are_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forking_with(
        monkeypatch,
        f"This process (pid={os.getpid()}) is multi-threaded, use of fork() may lead to "
        "deadlocks in the child.",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pid = server.fork_of_a_threaded_process()
        if pid == 0:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_other_warnings_of_a_fork_still_are(monkeypatch: pytest.MonkeyPatch) -> None:
    _forking_with(monkeypatch, "something else")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning, match="something else"):
            server.fork_of_a_threaded_process()
