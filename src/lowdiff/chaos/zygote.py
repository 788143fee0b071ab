"""The fork server of ``lowdiff chaos``: training processes without the interpreter's start-up.

Run as ``python -m lowdiff.chaos.zygote FD`` by :class:`lowdiff.chaos.launch.ForkLauncher`,
with ``FD`` one end of a ``SOCK_SEQPACKET`` socket pair. It imports torch, transformers,
the training job and the strategies once, then serves requests, one per message:

- request: JSON ``{"id": n, "config": PATH, "cwd": DIR, "env": {...}}`` with two file
  descriptors attached (the child's stdout and stderr);
- it forks a child, which starts a session of its own, takes those descriptors as its
  stdout and stderr, applies ``env`` and runs ``lowdiff.workloads.train.main(["--config",
  PATH])``, exactly the code of ``python -m lowdiff.workloads.train``;
- reply: ``{"id": n, "pid": PID}``; later, when the child exits,
  ``{"exit": PID, "code": CODE}`` (``-N`` for a child killed by signal ``N``).

The server holds no threads when it forks. It exits when its socket closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any


def _preload() -> None:
    # Everything a training process imports before its first step, so that a forked child
    # starts at the model build. No torch op runs here: the child sets its thread count.
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import GPT2LMHeadModel  # noqa: F401

    import lowdiff  # noqa: F401
    import lowdiff.baselines.checkfreq  # noqa: F401
    import lowdiff.baselines.dcp_async  # noqa: F401
    import lowdiff.baselines.gemini  # noqa: F401
    import lowdiff.baselines.naive_dc  # noqa: F401
    import lowdiff.baselines.torch_save  # noqa: F401
    import lowdiff.workloads.train  # noqa: F401
    from lowdiff.workloads import text

    text.load_corpus()


def _child(req: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    code = 1
    try:
        os.setsid()
        sock.close()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.update({str(k): str(v) for k, v in req.get("env", {}).items()})
        from lowdiff.workloads import train

        sys.argv = ["lowdiff.workloads.train", "--config", req["config"]]
        code = train.main(["--config", req["config"]])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting anyway
                f.flush()
        os._exit(code)


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.send(json.dumps(obj).encode())


def serve(sock: socket.socket) -> None:
    """Fork a training process per request until the socket closes."""
    t0 = time.perf_counter()
    _preload()
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
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
        if not msg:
            return
        req = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            _child(req, fds, sock)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(sock, {"id": req["id"], "pid": pid})


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m lowdiff.chaos.zygote FD``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m lowdiff.chaos.zygote FD", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(args[0]))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
