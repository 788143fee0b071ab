"""The measuring half of ``lowdiff bench``: arms, interleaved timing and the result record.

An *arm* is one way of training: a strategy (lowdiff's own, a baseline, ``"none"`` for
compressed training without checkpoints, or ``None`` for the plain loop) with its
options. :class:`Arena` builds every arm of an experiment on its own copy of the same
workload (same initial weights, same data), then times them **interleaved**: round by
round, each arm trains one block of iterations, in an order that rotates every round, so
that drift of a shared machine falls on every arm alike. The first block of each arm is a
warm-up and is not reported. Devices are synchronised before every clock read.

A block's time covers every iteration (forward, backward, ``ck.step()``, ``zero_grad``)
**and** the drain that ends it (``ck.flush()``: everything checkpointed in the block is
durable when the clock stops). Each arm therefore pays for all of its own work inside its
own timed blocks: nothing it checkpointed is written in untimed time, and none of its
background work spills into the next arm's block. The drain is also kept apart
(``drain_s``), and so is the time of the iterations alone (``iter_median_s``). Blocks
should be a multiple of every periodic interval of the arms (full-checkpoint interval,
record batch, durability interval): then every block holds the same share of each
periodic cost, and the median block is their fair average (:func:`block_length`).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import lowdiff
from lowdiff_lab import checkpointers
from lowdiff_lab.machine import total_memory_bytes
from lowdiff_lab.workloads import zoo


@dataclass(frozen=True)
class Arm:
    """One way of training, as an experiment compares it.

    Attributes:
        label: Name in tables and plots, e.g. ``"LowDiff"`` or ``"CheckFreq"``.
        strategy: Checkpointer strategy, ``"none"`` (compressed training, no checkpoint) or
            None (the plain loop: no Checkpointer at all).
        ratio: Top-k ratio of the training's gradient compression; None: uncompressed.
        full_every: The strategy's ``full_every`` (``"auto"``: the strategy's own policy).
        options: Further Checkpointer options, as ``(name, value)`` pairs.
        durable_every: Steps between two points at which the whole state is recoverable
            from disk (None: not fixed in advance, or no checkpoint).
        memory_every: Steps between two points that survive a crash of the training
            process alone (1 when every step is handed to a process that outlives it).
    """

    label: str
    strategy: str | None
    ratio: float | None = None
    full_every: int | str = 1
    options: tuple[tuple[str, Any], ...] = ()
    durable_every: int | None = None
    memory_every: int | None = None

    def describe(self) -> dict[str, Any]:
        """The arm as flat JSON-able fields (its options among them), for the rows."""
        return {
            "label": self.label,
            "strategy": self.strategy,
            "compression": None if self.ratio is None else f"topk:{self.ratio}",
            "full_every": self.full_every,
            "durable_every": self.durable_every,
            "memory_every": self.memory_every,
            **dict(self.options),
        }


@dataclass
class ArmRun:
    """An arm's live objects and what was measured on it."""

    arm: Arm
    workload: zoo.Workload
    optimizer: torch.optim.Optimizer
    ck: Any
    directory: Path | None
    step: int = 0
    blocks: list[float] = field(default_factory=list)
    """Seconds per iteration of each timed block, its final drain (``ck.flush()``) included."""
    iter_blocks: list[float] = field(default_factory=list)
    """Seconds per iteration of each timed block, iterations only (the drain left out)."""
    drains: list[float] = field(default_factory=list)
    """Seconds of each timed block's final drain."""
    phases: dict[str, float] = field(default_factory=dict)
    """Per-phase seconds summed over timed iterations (with ``phases=True``)."""
    timed_iters: int = 0

    def summary(self) -> dict[str, Any]:
        """The arm's figures: per-iteration medians, drains, phases and the strategy's stats."""
        s = summarize(self.blocks)
        s["iter_median_s"] = statistics.median(self.iter_blocks) if self.iter_blocks else None
        s["drain_s"] = statistics.median(self.drains) if self.drains else 0.0
        s["drain_max_s"] = max(self.drains) if self.drains else 0.0
        s["block_iters"] = self.timed_iters // max(1, len(self.blocks))
        if self.phases and self.timed_iters:
            s["phases_s"] = {k: v / self.timed_iters for k, v in self.phases.items()}
        if self.ck is not None:
            s["stats"] = {k: float(v) for k, v in self.ck.stats.items()}
        return s


def summarize(xs: list[float]) -> dict[str, Any]:
    """Median, min, max and count of a list of per-iteration times."""
    if not xs:
        return {"median_s": None, "min_s": None, "max_s": None, "n": 0}
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that a clock read after it sees it done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class BenchSettings:
    """What every experiment of one ``lowdiff bench`` run shares.

    Attributes:
        workload: Name in :data:`lowdiff_lab.workloads.zoo.WORKLOADS`.
        device: ``"cpu"`` or ``"cuda"``.
        iters: Iterations per timed block.
        repeats: Timed blocks per arm (after one warm-up block).
        workdir: Where checkpoint directories go (deleted at the end).
        lr: Adam learning rate.
        amp: Mixed precision of the workload (None, ``"bf16"``, ``"fp16"``).
        grad_accum: Micro-batches per optimizer step.
        batch_size: Workload batch size (None: its default).
    """

    workload: str
    device: str = "cpu"
    iters: int = 10
    repeats: int = 3
    workdir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    lr: float = 1e-4
    amp: str | None = None
    grad_accum: int = 1
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain JSON-able values (``workdir`` as a string), for the
        results file and for a spawned child (:meth:`from_dict`)."""
        return {**asdict(self), "workdir": str(self.workdir)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchSettings:
        """The settings :meth:`as_dict` gave."""
        return cls(**{**d, "workdir": Path(d["workdir"])})


def build_workload(s: BenchSettings) -> zoo.Workload:
    """The settings' workload, seeded alike for every arm (same weights, same data)."""
    return zoo.build_workload(
        s.workload,
        seed=0,
        device=s.device,
        amp=s.amp,
        grad_accum=s.grad_accum,
        batch_size=s.batch_size,
    )


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer every experiment trains with: Adam at ``lr``."""
    return torch.optim.Adam(model.parameters(), lr=lr)


def make_checkpointer(
    arm: Arm, model: torch.nn.Module, opt: torch.optim.Optimizer, directory: Path | None
) -> Any:
    """The arm's Checkpointer (None for the plain loop), resumed on an empty directory."""
    if arm.strategy is None:
        return None
    kwargs = dict(arm.options)
    if arm.strategy == "lowdiff+":
        compressor = None
    elif arm.ratio is not None:
        compressor = lowdiff.TopK(ratio=arm.ratio)
    elif arm.strategy in ("none", "lowdiff"):
        raise ValueError(f"arm {arm.label!r}: strategy {arm.strategy!r} needs a compression ratio")
    else:
        compressor = None
    ck = checkpointers.build(
        None if arm.strategy == "none" else directory,
        model,
        opt,
        arm.strategy,
        compressor=compressor,
        full_every=arm.full_every,
        **kwargs,
    )
    ck.resume()
    return ck


class Arena:
    """Every arm of one experiment, alive side by side, timed in interleaved blocks.

    Call sequence::

        with Arena(settings, arms, progress) as arena:   # builds every arm (not timed)
            arena.run()                                   # warm-up block, then repeats rounds
            results = arena.results()                     # {label: summary}
    """

    def __init__(
        self,
        settings: BenchSettings,
        arms: list[Arm],
        progress: Callable[[str], None] | None = None,
        *,
        phases: bool = False,
    ) -> None:
        labels = [a.label for a in arms]
        if len(set(labels)) != len(labels):
            raise ValueError(f"arm labels must be unique, got {labels}")
        self.s, self.arms, self.phases = settings, arms, phases
        self.progress = progress or (lambda _msg: None)
        self.runs: list[ArmRun] = []
        self._root = Path(tempfile.mkdtemp(prefix="lowdiff-bench-", dir=settings.workdir))

    def __enter__(self) -> Arena:
        try:
            for arm in self.arms:
                self.progress(f"starting {arm.label}")
                self.runs.append(self.build(arm))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def build(self, arm: Arm) -> ArmRun:
        """The arm's own workload, optimizer and Checkpointer, on a directory of its own."""
        wl = build_workload(self.s)
        opt = make_optimizer(wl.model, self.s.lr)
        d = self._root / f"{len(self.runs):02d}-{arm.strategy or 'plain'}"
        ck = make_checkpointer(arm, wl.model, opt, d)
        return ArmRun(arm, wl, opt, ck, None if arm.strategy in (None, "none") else d)

    def close(self) -> None:
        """Close every arm's Checkpointer and delete every checkpoint directory."""
        for r in self.runs:
            if r.ck is not None:
                with contextlib.suppress(Exception):
                    r.ck.close()
        shutil.rmtree(self._root, ignore_errors=True)

    def train_block(self, r: ArmRun, n: int, *, timed: bool) -> None:
        """Train ``r`` for ``n`` iterations and drain it; with ``timed``, record the block."""
        dev = r.workload.device
        phases = self.phases and timed
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            if phases:
                self._timed_iteration(r)
            else:
                r.workload.forward_backward(r.step)
                if r.ck is None:
                    r.optimizer.step()
                else:
                    r.ck.step()
                r.optimizer.zero_grad(set_to_none=True)
            r.step += 1
        sync(dev)
        t1 = time.perf_counter()
        if r.ck is not None:
            r.ck.flush()  # durable before the clock stops: the drain is the arm's own work
        sync(dev)
        t2 = time.perf_counter()
        if timed:
            r.blocks.append((t2 - t0) / n)
            r.iter_blocks.append((t1 - t0) / n)
            r.drains.append(t2 - t1)
            r.timed_iters += n

    def _timed_iteration(self, r: ArmRun) -> None:
        """One iteration with forward+backward and the update timed apart."""
        dev = r.workload.device
        t0 = time.perf_counter()
        r.workload.forward_backward(r.step)
        sync(dev)
        t1 = time.perf_counter()
        if r.ck is None:
            r.optimizer.step()
        else:
            r.ck.step()
        sync(dev)
        t2 = time.perf_counter()
        r.optimizer.zero_grad(set_to_none=True)
        r.phases["forward_backward"] = r.phases.get("forward_backward", 0.0) + t1 - t0
        r.phases["update_and_checkpoint"] = r.phases.get("update_and_checkpoint", 0.0) + t2 - t1

    def run(self) -> None:
        """A warm-up block per arm, then ``repeats`` rounds of one block each, in rotating order."""
        n = self.s.iters
        for r in self.runs:
            self.progress(f"warm-up {r.arm.label}")
            self.train_block(r, n, timed=False)
        k = len(self.runs)
        for rep in range(self.s.repeats):
            order = [self.runs[(rep + i) % k] for i in range(k)]
            for r in order:
                self.progress(f"round {rep + 1}/{self.s.repeats}: {r.arm.label}")
                self.train_block(r, n, timed=True)

    def results(self) -> dict[str, dict[str, Any]]:
        """``{label: summary}`` of every arm, its description included."""
        return {r.arm.label: {"arm": r.arm.describe(), **r.summary()} for r in self.runs}

    def disk_bytes(self, r: ArmRun) -> int:
        """Bytes the arm's checkpoint directory holds now."""
        return dir_bytes(r.directory) if r.directory is not None else 0


def block_length(iters: int, periods: list[int]) -> int:
    """The smallest multiple of every period in ``periods`` that is at least ``iters``.

    Example:
        >>> block_length(5, [20, 5])
        20
        >>> block_length(30, [4, 6])
        36
    """
    unit = 1
    for p in periods:
        if p < 1:
            raise ValueError(f"periods must be >= 1, got {p}")
        unit = math.lcm(unit, p)
    return unit * max(1, -(-iters // unit))


def newest_full_bytes(directory: Path | None) -> int | None:
    """Bytes of the newest full checkpoint after step 0 in ``directory/full`` (a file, or a
    DCP directory), or None when there is none.

    Step 0's checkpoint holds no optimizer state yet (nothing has been updated), so it
    is not the size a checkpoint has during training.
    """
    if directory is None:
        return None
    best: tuple[int, Path] | None = None
    for d in sorted(directory.rglob("full")):
        if not d.is_dir():
            continue
        for p in d.iterdir():
            if p.name.startswith(".") or p.name.endswith((".commit", ".tmp")):
                continue
            digits = "".join(c for c in p.name.split("-")[-1].split(".")[0] if c.isdigit())
            if not digits or int(digits) == 0:
                continue
            if best is None or int(digits) > best[0]:
                best = (int(digits), p)
    if best is None:
        return None
    p = best[1]
    return dir_bytes(p) if p.is_dir() else p.stat().st_size


def dir_bytes(path: Path | None) -> int:
    """Bytes of every file under ``path`` (0 when it is None or gone)."""
    if path is None or not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- provenance


def git_revision() -> str | None:
    """The lowdiff source tree's git revision (with ``-dirty``), or None outside a checkout."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def machine_info(device: str) -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lowdiff": lowdiff.__version__,
        "git_revision": git_revision(),
        "device": device,
        "env": {
            k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
        },
    }
    info["memory_gib"] = round(total_memory_bytes() / 2**30, 1)
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def crash_after(work: Callable[[], None], error_exit: int) -> None:
    """(child process) Run ``work``, then die by SIGKILL as a crashed trainer dies: no
    ``close()``, shared memory and the checkpointing processes left as a crash leaves them.

    If ``work`` raises, print the error and exit with ``error_exit`` at once: a normal exit
    would first wait for the checkpointing processes this process started, which wait for
    it.
    """
    try:
        work()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(error_exit)
    os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch threads (None: unchanged); the old count after."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
