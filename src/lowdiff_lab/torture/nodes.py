"""Whole "nodes" of a ``torchrun`` job on this machine, and the loss of one.

A node is one ``torchrun`` elastic agent (``python -m torch.distributed.run``) with its
workers, its own local directory and its own ``NODE_NAME``; the nodes of a job share a
c10d rendezvous on ``127.0.0.1``. :meth:`Node.lose` takes a node down the way a machine
goes down: its agent, its workers (torchrun starts each in a session of its own) and every
process they started are SIGKILLed, and its local directory is deleted. A new node can
then join the same rendezvous as its replacement (:meth:`Job.start` again).

Example:
    >>> with Job(script, ["--out", str(out)], base=tmp_path) as job:  # doctest: +SKIP
    ...     a, b = job.start("A"), job.start("B")
    ...     ...  # wait for the job to be mid-run
    ...     b.lose()
    ...     c = job.start("C")
    ...     assert a.wait(60) == 0 and c.wait(60) == 0

Finding the processes of a node: everything below its agent in the process tree, every
process in the session or process group of one of them (a worker's children stay in its
session after it died), and the processes the job lists in the node's pid file
(``PID [STARTTIME]`` per line: a process started in a session of its own and re-parented
away; with ``STARTTIME``, ``/proc/PID/stat`` field 22, a pid reused since is left alone).
They are stopped (SIGSTOP, so none can start another) until the set no longer grows,
then SIGKILLed.

Rank order: the c10d rendezvous sorts its participants by ``(local address, agent pid)``,
so among nodes with the same ``--local-addr`` the agent started first gets rank 0 -- as
long as pids do not wrap around (``/proc/sys/kernel/pid_max`` may be 32768). A node's
``local_addr`` decides before its pid does: the job's first node gets ``127.0.0.1``, the
later ones ``localhost`` (which sorts after it), so the first node is rank 0 of every round
whatever the pids. Only rank 0's address is ever connected to (it is ``MASTER_ADDR`` for
the workers), so every connection goes to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"

RDZV_CONF = {
    # a dead node's agent stops its heartbeats: it is dropped from the rendezvous
    # keep_alive_interval * keep_alive_max_attempt seconds after its last one (default
    # 5 * 3 = 15 s); until then the survivors cannot start a new round without it. 1 * 1
    # is too short: a live agent's heartbeat comes late and it is dropped too (the first
    # round then hung until read_timeout)
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 2,
    # how long a node waits in the rendezvous for the others before it gives up
    "join_timeout": 60,
    # once min-nodes are in, how long to wait for more (min == max: not used)
    "last_call_timeout": 1,
    "close_timeout": 10,
    # the rendezvous store's request timeout (its clients wait this long for it)
    "read_timeout": 30,
}
"""``--rdzv-conf`` of every node (integers: seconds); ``is_host`` is added per node."""

MONITOR_INTERVAL = 0.1
"""``--monitor-interval``: how often an agent checks its workers (seconds)."""

NODE_ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    # a restarted round must not read the previous round's addresses from a shared store
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    # gloo's connections: on the loopback interface
    "GLOO_SOCKET_IFNAME": "lo",
    "LOGLEVEL": "INFO",
}


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout: float, host: str = HOST) -> None:
    """Wait until something accepts connections on ``host:port``."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")
        time.sleep(0.05)


# --- processes, from /proc -------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """One process as ``/proc/PID/stat`` has it."""

    pid: int
    state: str
    ppid: int
    pgid: int
    sid: int
    start: int
    """Start time, clock ticks after boot (tells a pid's reuse apart)."""


def proc(pid: int) -> Proc | None:
    """The process ``pid``, or None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    f = stat.rsplit(")", 1)[1].split()  # the name (field 2) may hold spaces and ')'
    return Proc(pid, f[0], int(f[1]), int(f[2]), int(f[3]), int(f[19]))


def processes() -> dict[int, Proc]:
    """Every process there is now."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (p := proc(int(d))) is not None:
            out[p.pid] = p
    return out


def running(pid: int, start: int | None = None) -> bool:
    """``pid`` exists, is not a zombie and (with ``start``) is the process started then."""
    p = proc(pid)
    return p is not None and p.state not in ("Z", "X") and (start is None or p.start == start)


def listed(path: Path) -> list[tuple[int, int | None]]:
    """The ``(pid, start)`` lines of a pid file (``PID [STARTTIME]``); none if it is missing."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit():
            start = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
            out.append((int(parts[0]), start))
    return out


def _ours() -> set[int]:
    """Processes never to touch: this one, its session and group, init."""
    me = proc(os.getpid())
    keep = {0, 1, os.getpid()}
    if me is not None:
        keep |= {me.pgid, me.sid, me.ppid}
    return keep


Roots = Iterable[int] | Mapping[int, int | None]
"""Pids, or pids with their start times (a pid whose process started at another time has
been reused: it is left alone)."""


def closure(roots: Roots, pid_files: Iterable[Path] = ()) -> set[int]:
    """``roots`` that run, everything below them, everything in their sessions and process
    groups, and the running processes the pid files list, until the set stops growing."""
    keep = _ours()
    table = processes()
    pairs = list(roots.items()) if isinstance(roots, Mapping) else [(p, None) for p in roots]
    for path in pid_files:
        pairs += listed(path)
    found = {
        pid for pid, start in pairs if pid in table and (start is None or table[pid].start == start)
    } - keep
    while True:
        groups = {table[p].pgid for p in found} | {table[p].sid for p in found}
        groups -= keep
        more = {
            p.pid for p in table.values() if p.ppid in found or p.pgid in groups or p.sid in groups
        } - keep
        if more <= found:
            return {p for p in found if table[p].state not in ("Z", "X")}
        found |= more


def kill_all(roots: Roots, pid_files: Iterable[Path] = (), timeout: float = 10) -> dict[int, int]:
    """SIGKILL :func:`closure` of ``roots``: first SIGSTOP until the set stops growing (a
    stopped process cannot start another), then SIGKILL, then wait until none of them
    runs (a zombie does not). Returns the pids it killed, with their start times."""
    pairs = dict(roots.items()) if isinstance(roots, Mapping) else dict.fromkeys(roots)
    pid_files = list(pid_files)
    stopped: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = closure({**pairs, **stopped}, pid_files) - stopped.keys()
        if not new:
            break
        for pid in new:
            p = proc(pid)
            if p is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            stopped[pid] = p.start
    for pid, start in stopped.items():
        if running(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    while left := [pid for pid, start in stopped.items() if running(pid, start)]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"still running after SIGKILL: {left}")
        time.sleep(0.02)
    return stopped


# --- nodes ------------------------------------------------------------------------------


@dataclass
class Node:
    """One agent of the job and what belongs to it."""

    name: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    """The node's local directory (``NODE_DIR``): deleted when the node is lost."""
    log: Path
    """The agent's stdout and stderr (with its workers')."""
    pid_file: Path
    """Where the job lists processes it started in other sessions (``PID [STARTTIME]``)."""
    started: float = field(default_factory=time.time)
    lost: float | None = None
    """When :meth:`lose` SIGKILLed it (``time.time()``)."""
    killed: dict[int, int] = field(default_factory=dict)
    """The pids :meth:`lose` or :meth:`kill` SIGKILLed, with their start times."""

    @property
    def pid(self) -> int:
        """The agent's pid."""
        return self.proc.pid

    def _roots(self) -> dict[int, int | None]:
        # the agent's pid is ours until it is reaped; then only with its start time
        roots: dict[int, int | None] = dict(self.killed)
        if self.proc.poll() is None:
            roots[self.pid] = None
        return roots

    def processes(self) -> set[int]:
        """The node's processes that run now (:func:`closure` of its agent, of what was
        killed and of its pid file)."""
        return closure(self._roots(), [self.pid_file])

    def wait(self, timeout: float) -> int:
        """The agent's exit code; ``TimeoutError`` (with the log's tail) past ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"node {self.name} still runs after {timeout} s:\n{self.tail()}"
            ) from None

    def kill(self, timeout: float = 10) -> dict[int, int]:
        """SIGKILL the agent, its workers and every process of theirs (:func:`kill_all`)."""
        got = kill_all(self._roots(), [self.pid_file], timeout)
        self.killed.update(got)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        return got

    def lose(self, timeout: float = 10) -> dict[int, int]:
        """Lose the node: SIGKILL all its processes, then delete its local directory.
        Returns the pids killed."""
        self.lost = time.time()
        if self.proc.poll() is None:  # not reaped: its pid is still its process group's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGSTOP)  # the agent's session: frozen first
        got = self.kill(timeout)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return got

    def tail(self, n: int = 6000) -> str:
        """The end of the agent's log."""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return "(no log)"


def start_node(
    name: str,
    script: Path | str,
    args: Sequence[str],
    *,
    endpoint: str,
    rdzv_id: str,
    workdir: Path,
    logdir: Path,
    pid_file: Path,
    nnodes: int | str = 2,
    nproc_per_node: int = 1,
    max_restarts: int = 1,
    local_addr: str = HOST,
    is_host: bool | None = None,
    rdzv_conf: dict[str, object] | None = None,
    monitor_interval: float = MONITOR_INTERVAL,
    env: dict[str, str] | None = None,
) -> Node:
    """Start one node: ``python -m torch.distributed.run`` in a session of its own, with
    ``NODE_NAME=name`` and ``NODE_DIR=workdir`` (created) in its environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    logdir.mkdir(parents=True, exist_ok=True)
    conf = dict(RDZV_CONF if rdzv_conf is None else rdzv_conf)
    if is_host is not None:
        conf["is_host"] = int(is_host)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        ",".join(f"{k}={v}" for k, v in conf.items()),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        str(monitor_interval),
        "--local-addr",
        local_addr,
        "--log-dir",  # torchrun's own files (else a new /tmp/torchelastic_* per agent)
        str(logdir / "torchelastic"),
        str(script),
        *args,
    ]
    full_env = {
        **os.environ,
        **NODE_ENV,
        **(env or {}),
        "NODE_NAME": name,
        "NODE_DIR": str(workdir),
    }
    log = logdir / f"{name}.log"
    with open(log, "ab") as f:
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=workdir,
            start_new_session=True,
        )
    return Node(name, p, workdir, log, pid_file)


class Job:
    """The nodes of one rendezvous on 127.0.0.1; a context manager that kills every
    process of every node it started when it exits (whether or not the test failed).

    ``script`` runs with ``args`` on every node; the job writes its pid files to
    ``out / f"pids-{name}.txt"``. Nodes' local directories are ``base / "nodes" / name``,
    the agents' logs ``base / "logs" / f"{name}.log"``.
    """

    def __init__(
        self,
        script: Path | str,
        args: Sequence[str],
        base: Path,
        *,
        out: Path | None = None,
        nnodes: int | str = 2,
        max_restarts: int = 1,
        **node_kwargs: object,
    ) -> None:
        self.script, self.args, self.base = script, list(args), base
        self.out = base if out is None else out
        self.nnodes, self.max_restarts = nnodes, max_restarts
        self.node_kwargs = node_kwargs
        self.port = free_port()
        self.endpoint = f"{HOST}:{self.port}"
        self.rdzv_id = f"nodes-{uuid.uuid4().hex[:8]}"
        self.nodes: dict[str, Node] = {}

    def start(self, name: str, *, wait_store: float = 30, **kwargs: object) -> Node:
        """Start node ``name``. The first one hosts the rendezvous store (on
        :attr:`port`; this waits up to ``wait_store`` seconds until it listens) and has
        ``--local-addr 127.0.0.1``; the others are clients of it with ``localhost``."""
        if name in self.nodes:
            raise ValueError(f"node {name} exists")
        first = not self.nodes
        opts: dict[str, object] = {
            "nnodes": self.nnodes,
            "max_restarts": self.max_restarts,
            "is_host": first,
            "local_addr": HOST if first else "localhost",
            **self.node_kwargs,
            **kwargs,
        }
        node = start_node(
            name,
            self.script,
            self.args,
            endpoint=self.endpoint,
            rdzv_id=self.rdzv_id,
            workdir=self.base / "nodes" / name,
            logdir=self.base / "logs",
            pid_file=self.out / f"pids-{name}.txt",
            **opts,  # type: ignore[arg-type]
        )
        self.nodes[name] = node
        if first:
            try:
                wait_listening(self.port, wait_store)
            except TimeoutError:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"node {name} exited:\n{node.tail()}") from None
                raise
        return node

    def running(self) -> set[int]:
        """Every process of every node that runs now."""
        return set().union(*(n.processes() for n in self.nodes.values()))

    def close(self) -> None:
        """SIGKILL every process of every node (the ones started last first)."""
        errors = []
        for node in reversed(list(self.nodes.values())):
            try:
                node.kill()
            except Exception as e:  # noqa: BLE001 -- kill the others all the same
                errors.append(f"{node.name}: {e}")
        if errors:
            raise RuntimeError("could not kill every node: " + "; ".join(errors))

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
