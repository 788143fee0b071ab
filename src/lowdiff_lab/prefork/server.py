"""The server of :mod:`lowdiff_lab.prefork`: imports once, then forks a child per request.

Run as ``python -m lowdiff_lab.prefork FD [MODULE ...]`` by
:class:`lowdiff_lab.prefork.PreforkServer`, ``FD`` its end of a ``SOCK_SEQPACKET`` socket pair.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from lowdiff_lab.prefork.child import become_child, parse_argv

MAX_MSG = 1 << 20
"""The largest message (one request: its argv and environment)."""


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.send(json.dumps(obj).encode())


def _preload(modules: Sequence[str]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)


def serve(sock: socket.socket, preload: Sequence[str]) -> None:
    """Import ``preload``, then fork a child per request until the socket closes."""
    t0 = time.perf_counter()
    _preload(preload)
    _send(sock, {"ready": os.getpid(), "preload_s": time.perf_counter() - t0})
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.02)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_MSG, 3)
        if not msg:
            return
        req = json.loads(msg)
        if len(fds) != 3 or parse_argv(req["argv"]) is None:
            for fd in fds:
                os.close(fd)
            _send(sock, {"id": req["id"], "error": "bad request"})
            continue
        pid = os.fork()
        if pid == 0:
            become_child(req, fds, sock)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(sock, {"id": req["id"], "pid": pid})


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m lowdiff_lab.prefork FD [MODULE ...]``."""
    args = sys.argv[1:] if argv is None else argv
    if not args or not args[0].isdigit():
        print("usage: python -m lowdiff_lab.prefork FD [MODULE ...]", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(args[0]))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        serve(sock, args[1:])
    return 0
