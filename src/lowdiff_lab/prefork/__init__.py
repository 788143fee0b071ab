"""Python processes without the interpreter's start-up: forks of a warm server.

A new ``python`` that imports torch costs seconds of CPU before its first line of work
(about 2.5 s on a small CPU machine, more with transformers or ``torch._dynamo``, which
``DistributedDataParallel`` imports). The harness commands start many (``lowdiff demo``
and ``lowdiff chaos`` restart their trainers, ``lowdiff torture`` kills one at every
point it tries, a 2-rank job starts three), and so does a test suite that SIGKILLs real
trainers. :class:`PreforkServer` pays the imports once: it starts one server,
``python -m lowdiff_lab.prefork FD``, that imports the modules it is given and then forks a
child per request. The child becomes what ``python ARGS`` would have been:

- its own session (``os.setsid``), so a signal meant for the caller never reaches it;
- the given stdin, stdout and stderr, working directory and environment (the whole of
  ``env`` replaces the server's; entries of its ``PYTHONPATH`` go first on ``sys.path``);
- Python's own signal dispositions (SIGINT raises KeyboardInterrupt, SIGTERM kills);
- ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, and ``__main__`` run
  through :mod:`runpy` as ``python -m MODULE``, ``python SCRIPT`` or ``python -c CODE``
  do; stdout and stderr buffered as Python buffers them (``PYTHONUNBUFFERED``, ``-u``);
- at its end what the interpreter does: non-daemon threads joined, ``atexit`` handlers
  run, streams flushed; the exit code of ``SystemExit``, 1 after an uncaught exception
  (its traceback on stderr), ``-N`` for a child killed by signal ``N``.

:meth:`PreforkServer.popen` takes the arguments of :class:`subprocess.Popen` that these
uses need and returns a :class:`PreforkedProcess` with Popen's methods. What a forked
child cannot be is started the ordinary way (the call falls back to
:class:`subprocess.Popen`, and :attr:`PreforkedProcess.forked` says which): another
interpreter than ``sys.executable``, interpreter options other than ``-u``, ``-m`` and
``-c``, and an environment that changes what was fixed when the server imported
(``PYTHONHASHSEED``, ``PYTHONHOME``, ``LD_PRELOAD``, ``LD_LIBRARY_PATH``,
``CUDA_VISIBLE_DEVICES``).

The server holds no threads and runs no torch operation, so a forked child starts the
way a new interpreter would (GNU OpenMP's thread pool, for one, does not survive a fork
once it has started). It exits when its socket closes.

Protocol, one JSON message per ``SOCK_SEQPACKET`` packet:

- request ``{"id": n, "argv": [...], "cwd": DIR, "env": {...}}`` with three file
  descriptors attached (the child's stdin, stdout, stderr);
- reply ``{"id": n, "pid": PID}`` (or ``{"id": n, "error": "..."}``), and when the child
  exits ``{"exit": PID, "code": CODE}``.

Example:
    >>> with PreforkServer(preload=("torch",)) as server:  # doctest: +SKIP
    ...     p = server.popen([sys.executable, "-m", "mypkg.train", "--steps", "10"],
    ...                      stdout=subprocess.PIPE, text=True)
    ...     out, _ = p.communicate(timeout=60)
"""

from __future__ import annotations

from lowdiff_lab.prefork.child import run_as_python
from lowdiff_lab.prefork.client import BASE_PRELOAD, PreforkedProcess, PreforkError, PreforkServer
from lowdiff_lab.prefork.server import main, serve

__all__ = [
    "BASE_PRELOAD",
    "PreforkError",
    "PreforkServer",
    "PreforkedProcess",
    "main",
    "run_as_python",
    "serve",
]
