"""DCP's process-based saver (``async_mode="process"``): its daemon, started and stopped here.

DCP keeps one checkpoint daemon per trainer process, in a module global of
``torch.distributed.checkpoint._async_process_executor``, and starts it lazily inside the
first ``async_save``. :func:`acquire_process_saver` starts it up front through the same
constructor, so its start (spawning a process and joining a group) stays out of the step
times, and :func:`release_process_saver` stops it when the last checkpointer using it
closes. The daemon needs a process group: when the trainer has none, a single-rank gloo
group over an in-memory ``HashStore`` is created for as long as the daemon runs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch.distributed as dist


def _executor() -> Any:
    """DCP's process-based saver module (its private names are used), or None where
    this torch lacks it."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape
    except ImportError:
        return None
    return ape


def process_saver_available() -> bool:
    """Whether this torch has DCP's process-based saver (and ``torch.distributed``)."""
    if not dist.is_available():
        return False
    ape = _executor()
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError:
        return False
    return (
        ape is not None
        and hasattr(AsyncCheckpointerType, "PROCESS")
        and all(
            hasattr(ape, n)
            for n in ("_CHECKPOINT_PROCESS", "_AsyncCheckpointProcess", "_ProcessGroupInitInfo")
        )
    )


class _ProcessSaver:
    """The daemon of this process and who uses it (every checkpointer of the process)."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.users = 0
        self.own_group = False
        """The group was created here (the trainer had none): destroyed with the daemon."""
        self.own_daemon = False
        """The daemon was started here: stopped when the last user releases it."""

    def acquire(self) -> None:
        ape = _executor()
        assert ape is not None, "DCP's process-based saver is not available"
        with self.mutex:
            if self.users == 0:
                if not dist.is_initialized():
                    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                    self.own_group = True
                try:
                    if ape._CHECKPOINT_PROCESS is None:
                        info = ape._ProcessGroupInitInfo(None)
                        if self.own_group:
                            # a one-rank group on this machine: no host name lookup needed
                            info.tcp_store_master_addr = "127.0.0.1"
                        ape._CHECKPOINT_PROCESS = ape._AsyncCheckpointProcess(info)
                        self.own_daemon = True
                except BaseException:
                    if self.own_group:
                        dist.destroy_process_group()
                        self.own_group = False
                    raise
            self.users += 1

    def release(self, timeout: float) -> None:
        ape = _executor()
        assert ape is not None, "DCP's process-based saver is not available"
        with self.mutex:
            self.users -= 1
            if self.users > 0:
                return
            if self.own_daemon and ape._CHECKPOINT_PROCESS is not None:
                proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
                _stop_daemon(ape, proc, timeout)
            self.own_daemon = False
            if self.own_group and dist.is_initialized():
                dist.destroy_process_group()
            self.own_group = False


def _stop_daemon(ape: Any, proc: Any, timeout: float) -> None:
    """Ask DCP's daemon to terminate; terminate, then kill it if it does not in time."""
    sp = proc._save_process
    with contextlib.suppress(Exception):
        if sp.is_alive():
            proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
    sp.join(timeout)
    if sp.is_alive():
        sp.terminate()
        sp.join(timeout)
    if sp.is_alive():
        sp.kill()
        sp.join()
    with contextlib.suppress(Exception):
        proc._process_pipe.close()


_SAVER = _ProcessSaver()


def acquire_process_saver() -> None:
    """Start DCP's daemon now (not inside the first ``step()``), with a group if needed."""
    _SAVER.acquire()


def release_process_saver(timeout: float) -> None:
    """Stop DCP's daemon and destroy the group, once the last user is gone (if ours)."""
    _SAVER.release(timeout)


def saver_pid() -> int | None:
    """Process id of DCP's checkpoint daemon in this process, if one runs."""
    ape = _executor()
    proc = None if ape is None else getattr(ape, "_CHECKPOINT_PROCESS", None)
    return None if proc is None else proc._save_process.pid
