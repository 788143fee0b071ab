"""The caller's side of :mod:`lowdiff_lab.prefork`: :class:`PreforkServer` and its children."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from lowdiff_lab.prefork.child import parse_argv
from lowdiff_lab.prefork.server import MAX_MSG

BASE_PRELOAD = ("numpy", "torch", "lowdiff")
"""Modules every server imports; a server given ``preload`` imports these and those."""
_FIXED_AT_IMPORT = (
    "PYTHONHASHSEED",
    "PYTHONHOME",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
)
"""A change to one of these after the server's imports would not take effect in a fork."""


class PreforkError(RuntimeError):
    """The fork server could not start, or stopped answering."""


class PreforkedProcess:
    """A child of the fork server, with the methods of :class:`subprocess.Popen`.

    When the request could not be served by a fork (see the module docstring), it wraps
    an ordinary :class:`subprocess.Popen` and :attr:`forked` is False.
    """

    def __init__(
        self,
        args: list[str],
        server: PreforkServer | None,
        pid: int,
        stdin: IO[Any] | None,
        stdout: IO[Any] | None,
        stderr: IO[Any] | None,
        popen: subprocess.Popen[Any] | None = None,
    ) -> None:
        self.args = args
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._server = server
        self._popen = popen
        self._readers: list[threading.Thread] | None = None
        self._output: dict[str, Any] = {}

    @property
    def forked(self) -> bool:
        """True if the process is a fork of the warm server."""
        return self._popen is None

    def poll(self) -> int | None:
        """The exit code, or None while it runs (``-N`` if killed by signal ``N``)."""
        if self.returncode is None:
            if self._popen is not None:
                self.returncode = self._popen.poll()
            else:
                assert self._server is not None
                self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code; :class:`subprocess.TimeoutExpired` after ``timeout``."""
        if self._popen is not None:
            self.returncode = self._popen.wait(timeout)
            return self.returncode
        assert self._server is not None
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.returncode = code
        return code

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr to their end, then wait, as Popen does."""
        if self._popen is not None:
            out_err = self._popen.communicate(input, timeout)
            self.returncode = self._popen.returncode
            return out_err
        if input is not None:
            raise ValueError("communicate(input=...) is not supported by a forked process")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._readers is None:  # a later call (after a timeout) goes on with the same
            self._readers = [
                threading.Thread(target=self._drain, args=(name, f), daemon=True)
                for name, f in (("out", self.stdout), ("err", self.stderr))
                if f is not None
            ]
            for t in self._readers:
                t.start()
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return self._output.get("out"), self._output.get("err")

    def _drain(self, name: str, f: IO[Any]) -> None:
        self._output[name] = f.read()
        f.close()

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process, unless it has been reaped."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> PreforkedProcess:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        for f in (self.stdout, self.stderr, self.stdin):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self.wait()


class PreforkServer:
    """Starts Python processes as forks of a server that imported ``preload`` once.

    Args:
        preload: Modules the server imports (after :data:`BASE_PRELOAD`). Importing
            them must run no torch operation (see the module docstring).
        env: The server's environment (default: this process's).
        log_path: Where the server's own output goes (default: discarded).
        start_timeout: Seconds to wait for the server's imports.

    Raises:
        PreforkError: If the server does not start.
    """

    def __init__(
        self,
        preload: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        start_timeout: float = 300.0,
    ) -> None:
        self._env = dict(os.environ if env is None else env)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        modules = list(dict.fromkeys([*BASE_PRELOAD, *preload]))
        log: IO[Any] | int = subprocess.DEVNULL
        self._log: IO[Any] | None = None
        if log_path is not None:
            self._log = log = open(log_path, "w")  # noqa: SIM115 -- closed by close()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "lowdiff_lab.prefork", str(theirs.fileno()), *modules],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=self._env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._closed = False
        ready = self._recv_ready(start_timeout)
        if ready is None:
            self.close()
            where = f" (see {log_path})" if log_path is not None else ""
            raise PreforkError(f"the fork server did not start{where}")
        self.pid: int = int(ready["ready"])
        #: seconds the server spent importing ``preload``: what each child did not
        self.preload_s = float(ready["preload_s"])
        self._reader = threading.Thread(target=self._read, name="lowdiff-prefork", daemon=True)
        self._reader.start()

    def _recv_ready(self, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self._sock], [], [], 0.2)
            if r:
                msg = self._sock.recv(MAX_MSG)
                return json.loads(msg) if msg else None
            if self._proc.poll() is not None:
                return None
        return None

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(MAX_MSG)
            except OSError:
                msg = b""
            with self._cond:
                if not msg:
                    self._closed = True
                    self._cond.notify_all()
                    return
                obj = json.loads(msg)
                if "exit" in obj:
                    self._exits[int(obj["exit"])] = int(obj["code"])
                else:
                    self._replies[int(obj["id"])] = obj
                self._cond.notify_all()

    def exit_code(self, pid: int) -> int | None:
        """The exit code of child ``pid``, or None while it runs."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self._closed:
                return -signal.SIGKILL  # the server is gone: nothing will report the exit
            return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` for child ``pid``'s exit code (None if it still runs)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._closed, timeout)
        return self.exit_code(pid)

    def can_fork(self, args: Sequence[str], env: Mapping[str, str] | None = None) -> bool:
        """True if ``args`` (with ``env``) can be served as a fork (module docstring)."""
        if self._closed or not args or args[0] != sys.executable:
            return False
        if parse_argv(list(args[1:])) is None:
            return False
        env = self._env if env is None else env
        return all(env.get(k) == self._env.get(k) for k in _FIXED_AT_IMPORT)

    def popen(
        self,
        args: Sequence[str],
        *,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        text: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        start_new_session: bool = True,
    ) -> PreforkedProcess:
        """Start ``args`` (``[sys.executable, ...]``) as :class:`subprocess.Popen` would.

        ``stdin``, ``stdout`` and ``stderr`` take None (this process's own),
        ``subprocess.PIPE``, ``subprocess.DEVNULL``, ``subprocess.STDOUT`` (stderr only),
        a file descriptor or a file object. A forked child always has a session of its
        own; ``start_new_session`` is for the fallback.
        """
        args = [str(a) for a in args]
        if not self.can_fork(args, env):
            p = subprocess.Popen(
                args,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                text=text,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=start_new_session,
            )
            return PreforkedProcess(args, None, p.pid, p.stdin, p.stdout, p.stderr, popen=p)
        to_close: list[int] = []
        mine: dict[str, IO[Any]] = {}

        def child_fd(spec: int | IO[Any] | None, name: str, default: int) -> int:
            if spec is None:
                return default
            if spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                to_close.append(fd)
                return fd
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                theirs, ours = (r, w) if name == "stdin" else (w, r)
                to_close.append(theirs)
                mode = ("w" if name == "stdin" else "r") + ("" if text else "b")
                mine[name] = os.fdopen(ours, mode)
                return theirs
            if isinstance(spec, int):
                return spec
            return spec.fileno()

        try:
            fds = [child_fd(stdin, "stdin", 0), child_fd(stdout, "stdout", 1)]
            if stderr == subprocess.STDOUT:
                fds.append(fds[1])
            else:
                fds.append(child_fd(stderr, "stderr", 2))
            with self._cond:
                rid = self._next_id
                self._next_id += 1
            req = {
                "id": rid,
                "argv": args[1:],
                "cwd": str(Path.cwd() if cwd is None else cwd),
                "env": dict(self._env if env is None else env),
            }
            socket.send_fds(self._sock, [json.dumps(req).encode()], fds)
        except BaseException:
            for f in mine.values():
                f.close()
            raise
        finally:
            for fd in to_close:
                os.close(fd)
        with self._cond:
            got = self._cond.wait_for(lambda: rid in self._replies or self._closed, 60)
            reply = self._replies.pop(rid, None)
        if not got or reply is None or "pid" not in reply:
            for f in mine.values():
                f.close()
            why = reply.get("error") if reply else "no answer"
            raise PreforkError(f"the fork server did not start {args[1:]!r}: {why}")
        return PreforkedProcess(
            args, self, int(reply["pid"]), mine.get("stdin"), mine.get("stdout"), mine.get("stderr")
        )

    def run(
        self,
        args: Sequence[str],
        *,
        capture_output: bool = False,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        text: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``args`` to its end, as :func:`subprocess.run` does.

        Raises:
            subprocess.TimeoutExpired: After ``timeout`` seconds (the child is killed).
            subprocess.CalledProcessError: With ``check``, if it exits with another code than 0.
        """
        if capture_output:
            stdout = stderr = subprocess.PIPE
        p = self.popen(args, stdout=stdout, stderr=stderr, text=text, env=env, cwd=cwd)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        code = p.returncode
        assert code is not None
        if check and code:
            raise subprocess.CalledProcessError(code, list(args), out, err)
        return subprocess.CompletedProcess(list(args), code, out, err)

    def close(self) -> None:
        """Stop the server (its running children go on)."""
        # shutdown() first: a recv() blocked in the reader thread would otherwise keep
        # the socket open, and the server would never see its end
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> PreforkServer:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
