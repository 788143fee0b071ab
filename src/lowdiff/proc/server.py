"""The fork server, started as a fork of the trainer instead of a new interpreter.

lowdiff starts its background processes with multiprocessing's ``forkserver`` method
(:func:`lowdiff.proc.spawn.process_context`). Left to itself, multiprocessing starts the
server as a new interpreter that imports torch again: about two seconds of CPU before the
first background process can start, paid again by every trainer a job restarts. Here the
server is a fork of the trainer, taken the first time a process is needed, so it costs a
fork (milliseconds) and already holds torch, lowdiff and the trainer's main module: the
processes it forks do not run the main script again.

What the fork could carry over from the trainer is let go before the server serves:

- every file descriptor but its own and the standard streams is pointed at ``/dev/null``
  (numbers stay taken, so an object still holding one never closes a descriptor the
  server opened later). The trainer's sockets (process groups, stores) and ``flock``
  locks (the directory lock) are released with them: the trainer's peers see its death,
  and a new trainer can take the directory;
- every Python signal handler goes back to its default;
- torch's thread pool is set to one thread (an OpenMP pool does not survive a fork; the
  background processes run with one thread anyway);
- the objects inherited from the trainer are frozen (``gc.freeze``): no finalizer of the
  trainer's runs in the server or in a process it forks.

The server shares the trainer's memory as it was at the fork (copy on write), except the
training state: the pages of the CPU tensors of every Checkpointer's model and optimizer
are left out of the fork (:mod:`lowdiff.proc.forkmem`), so that the trainer's writes to
them take no copy and the server holds no copy of them. A page of anything else the
trainer changes later is copied once, and the server keeps the original. Threads other than the forking one are not copied, as
with any fork: the server and its processes touch nothing a trainer thread could hold
(no CUDA, no process group). This is the same footing as a ``DataLoader`` worker, which
PyTorch forks from the trainer on Linux by default.

The server serves as long as its trainer lives. When the trainer dies, the server lets
go of the trainer's standard streams and stays until every process it forked has exited
(:func:`_outlive_children`): a process that outlives its trainer then never holds the
dead trainer's memory alone, so its exit, which the next trainer's ``close()`` waits for
after a takeover, does not free that memory (the server does, once it is the last).

``LOWDIFF_PROCESS_START=interpreter`` in the trainer's environment restores
multiprocessing's own start of the server (a new interpreter that imports torch), and so
the second run of the main script in each new process. The fork is also not used where
it cannot be taken as described: off Linux, or with a ``multiprocessing`` whose fork
server this module does not know.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import signal
import socket
import sys
import threading
import warnings
from multiprocessing import connection, forkserver, resource_tracker, util
from typing import Any

from lowdiff.proc import env_choice, forkmem

ENV = "LOWDIFF_PROCESS_START"
"""Environment variable that chooses how the fork server starts: ``fork`` (the default)
or ``interpreter``."""

CHOICES = ("fork", "interpreter")

_MAIN_SIGNATURE = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
"""The parameters of ``multiprocessing.forkserver.main`` this module knows how to call."""

_lock = threading.Lock()


def start_method() -> str:
    """How the fork server starts in this process: ``"fork"`` or ``"interpreter"``.

    Raises:
        ValueError: If ``LOWDIFF_PROCESS_START`` holds anything else.
    """
    choice = env_choice(ENV, CHOICES)
    if choice == "fork" and not _fork_supported():
        return "interpreter"
    return choice


def _fork_supported() -> bool:
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self/fd"):
        return False
    try:
        params = tuple(inspect.signature(forkserver.main).parameters)
    except (TypeError, ValueError):
        return False
    return params == _MAIN_SIGNATURE


def ensure_running() -> None:
    """Make sure this process's fork server runs, started as :func:`start_method` says.

    A server already running (however it was started) is kept; one that has died is
    started again.
    """
    if start_method() != "fork":
        forkserver.ensure_running()
        return
    fs: Any = forkserver._forkserver
    with _lock, fs._lock:
        resource_tracker.ensure_running()
        if fs._forkserver_pid is not None:
            pid, _ = os.waitpid(fs._forkserver_pid, os.WNOHANG)
            if not pid:
                return
            os.close(fs._forkserver_alive_fd)
            fs._forkserver_address = fs._forkserver_alive_fd = fs._forkserver_pid = None
        _fork_server(fs)


def fork_of_a_threaded_process() -> int:
    """``os.fork()``, without Python's warning that the process has several threads.

    From Python 3.12 every fork of a process with more than one thread warns
    (``DeprecationWarning``: "use of fork() may lead to deadlocks in the child"); a GPU
    trainer always has threads (CUDA's, data loaders'). The server is built for that
    (module docstring: it touches nothing another thread could hold), and a user whose
    warnings are errors (``-W error``, pytest's ``filterwarnings = error``) would
    otherwise see training stop at the first checkpoint.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"This process \(pid=\d+\) is multi-threaded",
            category=DeprecationWarning,
        )
        return os.fork()


def _fork_server(fs: Any) -> None:
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            with contextlib.suppress(Exception):
                stream.flush()
        left_out = forkmem.leave_out()  # the training state stays the trainer's alone
        try:
            pid = fork_of_a_threaded_process()
        except BaseException:
            forkmem.give_back(left_out)
            os.close(alive_r)
            os.close(alive_w)
            raise
        if pid == 0:
            code = 1
            try:
                forkmem.fill(left_out)
                _serve(listener.fileno(), alive_r)
                code = 0
            except BaseException:
                with contextlib.suppress(BaseException):
                    sys.excepthook(*sys.exc_info())
                    sys.stderr.flush()
            finally:
                os._exit(code)
        forkmem.give_back(left_out)
        os.close(alive_r)
    fs._forkserver_address = address
    fs._forkserver_alive_fd = alive_w
    fs._forkserver_pid = pid


def _serve(listener_fd: int, alive_r: int) -> None:
    """In the forked server: let go of the trainer (see the module docstring), then serve."""
    global _lock
    gc.freeze()
    # the fork was taken holding both locks; a process this server forks may start
    # processes of its own
    _lock = threading.Lock()
    forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]
    _point_fds_at_devnull(keep={0, 1, 2, listener_fd, alive_r})
    _default_signal_handlers()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write("lowdiff-server")  # how ps and top name it (its command line is the trainer's)
    with contextlib.suppress(SystemExit):
        forkserver.main(listener_fd, alive_r, [])
    _outlive_children()


def _outlive_children() -> None:
    """The trainer is gone: let go of its standard streams (a launcher capturing them
    sees its end), then wait until every process this server forked has exited.

    A process that outlives its trainer (LowDiff's writer, LowDiff+'s replica, Gemini's
    holder) shares the trainer's memory with this server. Were the server gone, the
    survivor would be the last process holding those pages, and its exit, which the next
    trainer's ``close()`` waits for after a takeover, would free them all: about 30 ms
    for a trainer of 300 MB. Waiting here, the server frees them once the survivor has
    exited, and it reaps the survivor (which would otherwise stay a zombie where the
    first process of a container reaps nothing).
    """
    with contextlib.suppress(OSError, ValueError):
        signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _point_fds_at_devnull(keep=set())
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _point_fds_at_devnull(keep: set[int]) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in keep or fd == null:
                continue
            with contextlib.suppress(OSError):  # the listing's own descriptor, gone now
                os.fstat(fd)
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def _default_signal_handlers() -> None:
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(OSError, ValueError):
        signal.set_wakeup_fd(-1)
