"""The child side of :mod:`lowdiff_lab.prefork`: a forked process becomes ``python ARGS``."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any


def parse_argv(argv: Sequence[str]) -> tuple[str, str, list[str], bool] | None:
    """``python`` arguments as (kind, target, rest, unbuffered), or None if not handled.

    ``kind`` is ``"module"``, ``"script"`` or ``"code"``.
    """
    unbuffered = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-u":
            unbuffered = True
        elif a in ("-m", "-c"):
            if i + 1 >= len(argv):
                return None
            kind = "module" if a == "-m" else "code"
            return kind, argv[i + 1], list(argv[i + 2 :]), unbuffered
        elif a.startswith("-"):
            return None  # another interpreter option: not emulated
        else:
            return "script", a, list(argv[i + 1 :]), unbuffered
        i += 1
    return None  # an interactive interpreter


def _streams(unbuffered: bool) -> None:
    # new stream objects over fds 0, 1, 2, buffered as a new interpreter would: a
    # terminal is line-buffered, a pipe or file block-buffered, unless unbuffered
    def wrap(fd: int, mode: str, errors: str) -> Any:
        raw = io.FileIO(fd, mode, closefd=False)
        tty = raw.isatty()
        if mode == "rb":
            return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors=errors)
        if unbuffered:  # as ``python -u``: no buffer below the text layer
            return io.TextIOWrapper(raw, encoding="utf-8", errors=errors, write_through=True)
        return io.TextIOWrapper(
            io.BufferedWriter(raw), encoding="utf-8", errors=errors, line_buffering=tty
        )

    sys.stdin = wrap(0, "rb", "strict")
    sys.stdout = wrap(1, "wb", "strict")
    sys.stderr = wrap(2, "wb", "backslashreplace")
    # the interpreter's originals too, which faulthandler and some libraries write to
    setattr(sys, "__stdin__", sys.stdin)  # noqa: B010 -- typeshed marks them final
    setattr(sys, "__stdout__", sys.stdout)  # noqa: B010
    setattr(sys, "__stderr__", sys.stderr)  # noqa: B010


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _run_main(kind: str, target: str, rest: list[str]) -> None:
    import runpy

    if kind == "module":
        # as in a new interpreter, __main__ is a copy of its own: the module imported
        # by name (if the server preloaded it) is imported again by whoever asks for it
        sys.modules.pop(target, None)
        sys.argv = [target, *rest]  # runpy puts the module's file in argv[0]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "script":
        sys.argv = [target, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = ["-c", *rest]
        sys.path.insert(0, "")
        code = compile(target, "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


def _print_exception(e: BaseException) -> None:
    # as the interpreter prints it: without the frames of this module and of runpy
    import traceback

    tb = e.__traceback__
    runpy_file = os.path.abspath(getattr(sys.modules.get("runpy"), "__file__", ""))

    def ours(filename: str) -> bool:
        path = os.path.abspath(filename)
        return path == runpy_file or os.path.dirname(path) == os.path.dirname(__file__)

    while tb is not None and ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


def run_as_python(argv: Sequence[str]) -> int:
    """Run ``argv`` (the arguments of ``python``) in this process; its exit code.

    What the interpreter does around ``__main__`` is done too: an uncaught exception is
    printed, non-daemon threads are joined and ``atexit`` handlers run before this
    returns. Streams are not replaced (see :func:`_child`).

    Raises:
        ValueError: If ``argv`` is not ``[-u] -m MODULE ...``, ``[-u] -c CODE ...`` or
            ``[-u] SCRIPT ...``.
    """
    parsed = parse_argv(argv)
    if parsed is None:
        raise ValueError(f"not the arguments of a Python program: {list(argv)!r}")
    kind, target, rest, _unbuffered = parsed
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    try:
        _run_main(kind, target, rest)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:
        _print_exception(e)
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
    import atexit

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    return code


def become_child(req: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    code = 1
    try:
        os.setsid()
        sock.close()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(req["cwd"])
        env = {str(k): str(v) for k, v in req["env"].items()}
        os.environ.clear()
        os.environ.update(env)
        parsed = parse_argv(req["argv"])
        assert parsed is not None  # checked by the server
        _streams(parsed[3] or bool(env.get("PYTHONUNBUFFERED")))
        code = run_as_python(req["argv"])
    except BaseException as e:
        with contextlib.suppress(BaseException):
            _print_exception(e)
    finally:
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):  # exiting anyway
                f.flush()
        os._exit(code & 0xFF)
