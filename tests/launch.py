"""The tests' trainer processes: forks of one warm Python (:mod:`lowdiff_lab.prefork`).

A trainer that a test SIGKILLs and restarts would otherwise be a new interpreter that
imports torch (and, for DDP, ``torch._dynamo``) again: seconds of CPU each time, most of
the suite's time. :func:`popen` and :func:`run` take the arguments of
:class:`subprocess.Popen` and :func:`subprocess.run`; the child is what ``python ARGS``
would have been (see :mod:`lowdiff_lab.prefork`). What a fork cannot stand in for (an
interpreter's own start, the ``python -m lowdiff`` entry point, ``torchrun`` itself) is
tested with real processes.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lowdiff
from lowdiff_lab.prefork import PreforkedProcess, PreforkServer

PRELOAD = (
    "torch._dynamo",  # what DistributedDataParallel imports
    "torch.distributed.run",
    "transformers",
    "transformers.trainer",  # the Trainer integration's runs
    "lightning",  # the Lightning integration's runs
    "lowdiff_lab.baselines.checkfreq",
    "lowdiff_lab.baselines.dcp_async",
    "lowdiff_lab.baselines.gemini",
    "lowdiff_lab.baselines.naive_dc",
    "lowdiff_lab.baselines.torch_save",
    "lowdiff_lab.torture.ddp_agent",
    "lowdiff_lab.torture.ddp_job",
    "lowdiff_lab.torture.job",
    "lowdiff_lab.workloads.train",
)

_server: PreforkServer | None = None
_lock = threading.Lock()


def env() -> dict[str, str]:
    """This process's environment with lowdiff's source first on ``PYTHONPATH``."""
    e = dict(os.environ)
    src = str(Path(lowdiff.__file__).resolve().parents[1])
    e["PYTHONPATH"] = src + os.pathsep + e.get("PYTHONPATH", "")
    return e


def server() -> PreforkServer:
    """The warm Python of this test process (started at the first call)."""
    global _server
    with _lock:
        if _server is None:
            _server = PreforkServer(PRELOAD, env=env())
            atexit.register(_server.close)
        return _server


def popen(args: Sequence[str], **kwargs: Any) -> PreforkedProcess:
    """:class:`subprocess.Popen` of ``[sys.executable, ...]``, forked."""
    return server().popen(args, **kwargs)


def run(args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` of ``[sys.executable, ...]``, forked."""
    return server().run(args, **kwargs)
