"""``lowdiff demo``: kill a real training job mid-run, resume it, and prove the state exact.

The demo runs the training job of :mod:`lowdiff.workloads.train` four times, each as a
real child process, one after the other (two CPU-bound jobs side by side would disturb
each other's timings):

a) ``strategy="lowdiff"``; SIGKILLed when it reports a randomly chosen step (seeded by
   ``--seed``, between 40% and 80% of the run);
b) the same job restarted on the same directory: it resumes, dumps its whole training
   state right after ``resume()``, and finishes;
c) ``strategy="none"`` (same compression, no checkpointing) uninterrupted, dumping its
   state at the step (b) recovered: the reference;
d) ``strategy="lowdiff"`` uninterrupted in a fresh directory, timed against (c).

It then compares the two dumps tensor by tensor with ``torch.equal``, reads the record and
full-checkpoint sizes of (d)'s directory, and prints a report (``--json`` also writes it).
The exit code is 0 when the recovered state is bit-identical to the reference, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from lowdiff.cli.common import child_env, fmt_bytes, sigterm_as_interrupt

COMPRESSORS: dict[str, str] = {
    "topk": "TopK",
    "approx-topk": "ApproxTopK",
    "randomk": "RandomK",
    "qsgd": "QSGD",
}
"""``--compressor`` choice -> class name in :mod:`lowdiff.compressors`."""

STRATEGIES = ("lowdiff", "lowdiff+")
"""Strategies the demo can exercise (``lowdiff+`` comes later)."""


@dataclass(frozen=True)
class Profile:
    """Workload defaults of one demo profile (each can be overridden by a flag)."""

    model: str
    steps: int
    train_batch_size: int
    seq_len: int
    lr: float
    full_every: int
    batch_size: int
    keep_full: int
    eval_batches: int


PROFILES: dict[str, Profile] = {
    # ~150 ms/step on 2 cores: the four runs (about 3.4 x steps in all) plus four process
    # start-ups of ~8 s each take about two minutes, under three on a busy machine.
    "default": Profile("gpt2-demo", 180, 8, 128, 3e-3, 30, 3, 2, 8),
    # For tests: a few seconds of training; full_every 10 so that the kill lands after
    # at least one full checkpoint past step 0 and recovery replays records on top of it.
    "quick": Profile("gpt2-tiny", 40, 4, 64, 3e-3, 10, 3, 2, 4),
}

WARMUP_SKIP_MAX = 10
"""At most this many leading steps of each timed run are left out of the overhead."""


class DemoError(RuntimeError):
    """A phase of the demo did not behave as the demo needs (a child failed, ...)."""


# --------------------------------------------------------------------------- arguments
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on an ``argparse`` sub-parser collection.

    Args:
        subparsers: The object returned by ``ArgumentParser.add_subparsers()``.

    Returns:
        The new ``demo`` parser (its ``func`` default is :func:`run_demo`).
    """
    p = subparsers.add_parser(
        "demo",
        help="kill a real training job mid-run, resume it, check the state is bit-identical",
        description=(
            "Train a real job, SIGKILL it mid-run, resume it, and check the recovered "
            "training state is bit-identical to an uninterrupted reference; also measures "
            "record sizes, recovery time and training-time overhead."
        ),
    )
    p.add_argument(
        "--quick", action="store_true", help="small profile for tests (gpt2-tiny, 40 steps)"
    )
    p.add_argument(
        "--model", default=None, help="named model (default: gpt2-demo; gpt2-tiny with --quick)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per run (default: 180; 40 with --quick)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the model, the data order and the kill step"
    )
    p.add_argument(
        "--strategy", choices=STRATEGIES, default="lowdiff", help="checkpointing strategy"
    )
    p.add_argument(
        "--compressor", choices=sorted(COMPRESSORS), default="topk", help="gradient compressor"
    )
    p.add_argument(
        "--ratio", type=float, default=0.01, help="kept fraction for sparsifiers (default 0.01)"
    )
    p.add_argument(
        "--full-every", type=int, default=None, help="steps between full checkpoints (default 30)"
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="records per write batch (default 3)"
    )
    p.add_argument(
        "--keep-full", type=int, default=None, help="full checkpoints to keep (default 2)"
    )
    p.add_argument("--train-batch-size", type=int, default=None, help="training sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per training sequence")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of each training process (default: CPU count)",
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="where runs, dumps and logs go (default: a fresh temporary directory, kept)",
    )
    p.add_argument(
        "--json", default=None, metavar="FILE", help="also write the report as JSON here"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_demo)
    return p


# --------------------------------------------------------------------------- children
@dataclass
class ChildRun:
    """What the demo learned from one training process."""

    name: str
    returncode: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    killed_at: int | None = None
    durable_at_kill: int | None = None
    stderr_path: Path | None = None

    def last(self, event: str) -> dict[str, Any] | None:
        """The last event of this kind, if any."""
        for ev in reversed(self.events):
            if ev.get("event") == event:
                return ev
        return None


class _Children:
    """Tracks every child (each leads its own process group) so nothing outlives the demo."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def kill_all(self) -> None:
        for proc in self.procs:
            running = proc.poll() is None
            if running or proc.returncode != 0:
                # The checkpointing process a trainer spawned lives in the trainer's group
                # and may outlive a trainer that did not close() it. A cleanly exited
                # trainer left an empty group, so its id is never signalled (it could
                # belong to someone else by now).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)


def _pump(stream: IO[str], sink: queue.Queue[str | None], log: IO[str]) -> None:
    # Runs until every holder of the pipe closed it, which after a SIGKILL includes the
    # orphaned checkpointing process; draining on a thread keeps that from blocking the
    # demo, and the thread owns (and closes) both files.
    try:
        for line in stream:
            log.write(line)
            log.flush()
            sink.put(line)
    finally:
        sink.put(None)
        stream.close()
        log.close()


def run_child(
    name: str,
    config: dict[str, Any],
    workdir: Path,
    env: dict[str, str],
    children: _Children,
    on_event: Callable[[dict[str, Any]], bool] | None = None,
) -> ChildRun:
    """Run one training job to completion, or until ``on_event`` asks for a SIGKILL.

    Args:
        name: Phase name, used for the config, stdout and stderr file names.
        config: Training config (see :class:`lowdiff.workloads.train.TrainConfig`).
        workdir: Directory for the config and logs.
        env: Child environment.
        children: Registry used to clean up on interruption.
        on_event: Called with every JSON event; returning ``True`` SIGKILLs the child at
            once (the event's ``step`` is recorded as ``killed_at``).

    Returns:
        The :class:`ChildRun`; ``returncode`` is ``-SIGKILL`` for a killed child.
    """
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / f"{name}.config.json"
    cfg_path.write_text(json.dumps(config, indent=1))
    stderr_path = logs / f"{name}.stderr.log"
    run = ChildRun(name=name, stderr_path=stderr_path)
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lowdiff.workloads.train", "--config", str(cfg_path)],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=str(workdir),
            # Own session: a Ctrl-C at the terminal reaches only the demo, which then
            # kills the whole group (trainer and its checkpointing process) itself.
            start_new_session=True,
        )
    children.procs.append(proc)
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    out = open(logs / f"{name}.stdout.jsonl", "w")  # noqa: SIM115 - closed by _pump
    pump = threading.Thread(target=_pump, args=(proc.stdout, lines, out), daemon=True)
    pump.start()
    while True:
        line = lines.get()
        if line is None:
            break
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        run.events.append(ev)
        if on_event is not None and on_event(ev):
            os.kill(proc.pid, signal.SIGKILL)
            run.killed_at = ev.get("step")
            run.durable_at_kill = ev.get("durable")
            break
    run.returncode = proc.wait()
    if run.killed_at is None:
        # EOF was seen, so the pump is finishing; after a kill it may still be draining
        # what the orphaned checkpointing process prints, and is left to do so.
        pump.join(timeout=30)
    return run


def _stderr_tail(run: ChildRun, n: int = 25) -> str:
    if run.stderr_path is None or not run.stderr_path.exists():
        return ""
    lines = run.stderr_path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def _require_ok(run: ChildRun) -> None:
    if run.returncode != 0:
        raise DemoError(
            f"training process {run.name!r} exited with {run.returncode}; "
            f"stderr ({run.stderr_path}):\n{_stderr_tail(run)}"
        )


# --------------------------------------------------------------------------- analysis
def compare_states(path_a: Path, path_b: Path) -> dict[str, Any]:
    """Compare two state dumps key by key with ``torch.equal`` (dtype and shape included).

    Returns:
        ``{"bit_identical": bool, "n_keys": int, "mismatched_keys": [...],
        "only_in_recovered": [...], "only_in_reference": [...]}``.
    """
    from safetensors.torch import load_file

    from lowdiff.engine.state import diff_states

    a = load_file(str(path_a))
    b = load_file(str(path_b))
    problems = diff_states(a, b)
    only_a = [p.removeprefix("missing ") for p in problems if p.startswith("missing ")]
    only_b = [p.removeprefix("extra ") for p in problems if p.startswith("extra ")]
    mismatched = [p for p in problems if not p.startswith(("missing ", "extra "))]
    return {
        "bit_identical": not (mismatched or only_a or only_b),
        "n_keys": len(set(a) | set(b)),
        "mismatched_keys": mismatched,
        "only_in_recovered": only_a,
        "only_in_reference": only_b,
    }


def storage_stats(directory: Path, n_params: int, compressor: dict[str, Any]) -> dict[str, Any]:
    """Record and full-checkpoint sizes of a finished lowdiff directory."""
    import lowdiff

    info = lowdiff.inspect_dir(directory)
    rec_bytes = sum(f.nbytes for f in info.record_files)
    n_records = sum(f.n_records for f in info.record_files)
    fulls = [f.nbytes for f in info.full_checkpoints]
    per_record = rec_bytes / n_records if n_records else None
    per_full = sum(fulls) / len(fulls) if fulls else None
    ratio = (
        compressor.get("ratio")
        if compressor.get("kind") in ("topk", "approx-topk", "randomk")
        else None
    )
    return {
        "record_files": len(info.record_files),
        "records": n_records,
        "record_bytes_total": rec_bytes,
        "bytes_per_record": per_record,
        "full_checkpoints": len(fulls),
        "bytes_per_full": per_full,
        "full_over_record": per_full / per_record if per_record and per_full else None,
        "record_bytes_per_param": per_record / n_params if per_record else None,
        # A sparsifier keeps ratio * n values: 4-byte value + 4-byte index each.
        "expected_bytes_per_param": 8 * ratio if ratio is not None else None,
        "recoverable": list(info.recoverable) if info.recoverable else None,
    }


def _warmup_skip(n: int) -> int:
    return min(WARMUP_SKIP_MAX, max(1, n // 20))


def overhead_stats(reference: dict[str, Any], lowdiff_run: dict[str, Any]) -> dict[str, Any]:
    """Training-time overhead of (d) over (c) on steady-state steps.

    Both the median step time (robust to the stalls of a shared machine) and the summed
    step time (which includes the periodic full-checkpoint steps) are compared.
    """
    a = reference["step_times"]
    b = lowdiff_run["step_times"]
    skip = _warmup_skip(min(len(a), len(b)))
    a, b = a[skip:], b[skip:]
    if not a or not b:
        return {"warmup_steps_skipped": skip, "steps_timed": 0}
    med_a, med_b = statistics.median(a), statistics.median(b)
    tot_a, tot_b = sum(a), sum(b)
    return {
        "warmup_steps_skipped": skip,
        "steps_timed": min(len(a), len(b)),
        "median_step_s_none": med_a,
        "median_step_s_lowdiff": med_b,
        "median_overhead_pct": 100.0 * (med_b / med_a - 1.0),
        "total_s_none": tot_a,
        "total_s_lowdiff": tot_b,
        "total_overhead_pct": 100.0 * (tot_b / tot_a - 1.0),
        "close_s_lowdiff": lowdiff_run.get("close_s"),
    }


def machine_info(threads: int) -> dict[str, Any]:
    """Where the numbers were measured."""
    import torch

    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "threads_per_run": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def compressor_spec(kind: str, ratio: float) -> dict[str, Any]:
    """The JSON spec of the chosen compressor, built by the compressor class itself."""
    import lowdiff.compressors as comp

    cls = getattr(comp, COMPRESSORS[kind])
    kwargs: dict[str, Any] = {}
    if "ratio" in inspect.signature(cls).parameters:
        kwargs["ratio"] = ratio
    return dict(cls(**kwargs).spec())


# --------------------------------------------------------------------------- report
def _fmt(x: float | None, spec: str = ".4f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def lowdiff_rows(
    sg: dict[str, Any], rc: dict[str, Any], wc: dict[str, Any]
) -> list[tuple[str, str]]:
    return [
        (
            "bytes per record",
            f"{fmt_bytes(sg['bytes_per_record'])}  ({sg['records']} records in {sg['record_files']} files)",
        ),
        (
            "bytes per full checkpoint",
            f"{fmt_bytes(sg['bytes_per_full'])}  ({_fmt(sg['full_over_record'], '.0f', 'x')} a record)",
        ),
        (
            "record bytes per parameter",
            f"{_fmt(sg['record_bytes_per_param'])}  (8*ratio = {_fmt(sg['expected_bytes_per_param'])})",
        ),
        (
            "recovery time",
            f"{_fmt(rc.get('total_s'), '.3f', ' s')}: read {_fmt(rc.get('read_s'), '.3f', ' s')}, "
            f"decode {_fmt(rc.get('decode_s'), '.3f', ' s')}, replay {_fmt(rc.get('replay_s'), '.3f', ' s')} "
            f"({rc.get('records_replayed', 'n/a')} record(s) replayed on the full checkpoint of "
            f"step {rc.get('full_step', 'n/a')})",
        ),
        (
            "recovery time, worst case",
            f"{_fmt(wc.get('total_s'), '.3f', ' s')}: read {_fmt(wc.get('read_s'), '.3f', ' s')}, "
            f"decode {_fmt(wc.get('decode_s'), '.3f', ' s')}, replay {_fmt(wc.get('replay_s'), '.3f', ' s')} "
            f"({wc.get('records_replayed', 'n/a')} record(s) replayed on the full checkpoint of "
            f"step {wc.get('full_step', 'n/a')}, to step {wc.get('step', 'n/a')})",
        ),
    ]


def plus_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Report rows of a LowDiff+ demo: memory against disk recovery, trainer waiting."""
    sg, mem, disk = r["storage"], r["recovery"] or {}, r.get("recovery_worst_case") or {}
    ts = r.get("trainer_stats") or {}
    steps = max(1, int(ts.get("steps", 0) or 0))
    ratio = (
        disk.get("total_s") / mem["total_s"] if mem.get("total_s") and disk.get("total_s") else None
    )
    return [
        (
            "bytes per full checkpoint",
            f"{fmt_bytes(sg['bytes_per_full'])}  ({sg['full_checkpoints']} persisted replicas kept)",
        ),
        (
            "recovery from memory",
            f"{_fmt(mem.get('total_s'), '.4f', ' s')}  (source: {mem.get('source', 'n/a')}, "
            f"{mem.get('files_read', 'n/a')} files read, step {mem.get('step', 'n/a')})",
        ),
        (
            "recovery from disk",
            f"{_fmt(disk.get('total_s'), '.4f', ' s')}: read {_fmt(disk.get('read_s'), '.4f', ' s')}, "
            f"load {_fmt((disk.get('decode_s') or 0) + (disk.get('replay_s') or 0), '.4f', ' s')} "
            f"(full checkpoint of step {disk.get('step', 'n/a')}; {_fmt(ratio, '.1f', 'x')} the memory recovery)",
        ),
        (
            "trainer wait per step",
            f"{_fmt(_ms((ts.get('lag_wait_s') or 0) / steps), '.2f', ' ms')} for a free snapshot slot (bounded lag), "
            f"{_fmt(_ms((ts.get('snapshot_finish_s') or 0) / steps), '.2f', ' ms')} finishing snapshots, "
            f"{_fmt(_ms((ts.get('record_send_s') or 0) / steps), '.2f', ' ms')} handing the step over",
        ),
    ]


def format_report(r: dict[str, Any]) -> str:
    """Render the report dict as an aligned two-column table."""
    m, k, st, ls, sg, rc, ov, mc = (
        r["model"],
        r["kill"],
        r["state_check"],
        r["loss"],
        r["storage"],
        r["recovery"] or {},
        r["overhead"],
        r["machine"],
    )
    wc = r.get("recovery_worst_case") or {}
    mismatch = st["mismatched_keys"] + st["only_in_recovered"] + st["only_in_reference"]
    rows: list[tuple[str, str]] = [
        ("model", f"{m['name']} ({m['n_params']:,} parameters)"),
        ("compressor", json.dumps(r["compressor"])),
        (
            "steps",
            f"{r['steps']}  (full every {r['full_every']}, {r['batch_size']} records per write)"
            if r["strategy"] != "lowdiff+"
            else f"{r['steps']}  (replica persisted as often as the disk keeps up, lag at most 2 steps)",
        ),
        (
            "kill step (SIGKILL sent)",
            f"{k['kill_step']}  (target {k['target_step']}, durable then {k['durable_at_kill']})",
        ),
        ("recovered step", f"{k['recovered_step']}"),
        (
            "state at recovered step",
            f"bit-identical: {'yes' if st['bit_identical'] else 'no'}  ({st['n_keys']} tensors)",
        ),
    ]
    if mismatch:
        shown = ", ".join(mismatch[:12]) + (" ..." if len(mismatch) > 12 else "")
        rows.append(("  mismatching keys", f"{len(mismatch)}: {shown}"))
    rows += [
        (
            "final loss, recovered / reference",
            f"{_fmt(ls['recovered_final'])} / {_fmt(ls['reference_final'])}  (mean of last 10 steps)",
        ),
        (
            "held-out loss, recovered / reference",
            f"{_fmt(ls['recovered_eval'])} / {_fmt(ls['reference_eval'])}",
        ),
        *(plus_rows(r) if r["strategy"] == "lowdiff+" else lowdiff_rows(sg, rc, wc)),
        (
            "overhead vs none (median step)",
            f"{_fmt(ov.get('median_overhead_pct'), '+.1f', ' %')}  ({_fmt(_ms(ov.get('median_step_s_lowdiff')), '.1f', ' ms')} vs "
            f"{_fmt(_ms(ov.get('median_step_s_none')), '.1f', ' ms')})",
        ),
        (
            "overhead vs none (total)",
            f"{_fmt(ov.get('total_overhead_pct'), '+.1f', ' %')}  ({_fmt(ov.get('total_s_lowdiff'), '.1f', ' s')} vs "
            f"{_fmt(ov.get('total_s_none'), '.1f', ' s')} over {ov.get('steps_timed')} steps, "
            f"first {ov.get('warmup_steps_skipped')} skipped)",
        ),
        (
            "machine",
            f"{mc['cpu_count']} CPUs ({mc['cpus_usable']} usable), {mc['threads_per_run']} threads/run, torch {mc['torch']}",
        ),
        ("output directory", str(r["out_dir"])),
        ("demo wall time", f"{r['wall_s']:.1f} s"),
    ]
    width = max(len(a) for a, _ in rows)
    title = "lowdiff demo: kill, resume, compare"
    lines = [title, "=" * len(title)]
    lines += [f"{a.ljust(width)}  {b}" for a, b in rows]
    return "\n".join(lines)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000.0 * x


# --------------------------------------------------------------------------- progress
class _Progress:
    """A tqdm bar over all phases (falls back to nothing if tqdm is missing or disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._last = 0
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is an optional ("demo") dependency
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)

    def phase(self, desc: str, start_step: int = 0) -> None:
        self._last = start_step
        if self._bar is not None:
            self._bar.set_description(desc)

    def grow(self, n: int) -> None:
        if self._bar is not None and n > 0:
            self._bar.total += n
            self._bar.refresh()

    def event(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "resumed":
            self._last = int(ev.get("step", 0))
        elif ev.get("event") == "step":
            s = int(ev["step"])
            if self._bar is not None and s > self._last:
                self._bar.update(s - self._last)
                self._bar.set_postfix(loss=f"{ev.get('loss', float('nan')):.3f}", refresh=False)
            self._last = max(self._last, s)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# --------------------------------------------------------------------------- main job
@dataclass(frozen=True)
class DemoSettings:
    """Resolved settings of one demo run."""

    profile: Profile
    seed: int
    strategy: str
    compressor: dict[str, Any]
    threads: int
    out_dir: Path
    progress: bool


def resolve_settings(args: argparse.Namespace) -> DemoSettings:
    """Turn parsed arguments into settings, validating them."""
    from lowdiff.workloads.models import MODELS

    prof = PROFILES["quick" if args.quick else "default"]
    overrides = {
        "model": args.model,
        "steps": args.steps,
        "full_every": args.full_every,
        "batch_size": args.batch_size,
        "keep_full": args.keep_full,
        "train_batch_size": args.train_batch_size,
        "seq_len": args.seq_len,
    }
    prof = replace(prof, **{k: v for k, v in overrides.items() if v is not None})
    if prof.model not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)}, got {prof.model!r}")
    if prof.steps < 10:
        raise ValueError(f"--steps must be >= 10, got {prof.steps}")
    for name in ("full_every", "batch_size", "keep_full", "train_batch_size", "seq_len"):
        if getattr(prof, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(prof, name)}")
    if not 0.0 < args.ratio <= 1.0:
        raise ValueError(f"--ratio must be in (0, 1], got {args.ratio}")
    threads = args.threads or os.cpu_count() or 1
    if args.out_dir:
        out_dir = Path(args.out_dir).resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        if any(out_dir.iterdir()):
            raise ValueError(f"--out-dir {out_dir} is not empty")
    else:
        out_dir = Path(tempfile.mkdtemp(prefix="lowdiff-demo-"))
    return DemoSettings(
        profile=prof,
        seed=args.seed,
        strategy=args.strategy,
        compressor={"kind": "none"}
        if args.strategy == "lowdiff+"
        else compressor_spec(args.compressor, args.ratio),
        threads=threads,
        out_dir=out_dir,
        progress=not args.no_progress,
    )


def kill_target(seed: int, steps: int) -> int:
    """The step whose report triggers the SIGKILL: uniform in [40%, 80%] of the run."""
    lo = max(1, round(0.4 * steps))
    hi = max(lo, round(0.8 * steps))
    return random.Random(seed).randint(lo, hi)


def _base_config(s: DemoSettings, directory: Path, strategy: str) -> dict[str, Any]:
    p = s.profile
    return {
        "directory": str(directory),
        "model": p.model,
        "seed": s.seed,
        "steps": p.steps,
        "batch_size": p.train_batch_size,
        "seq_len": p.seq_len,
        "lr": p.lr,
        "strategy": strategy,
        "compressor": s.compressor,
        "full_every": p.full_every,
        "batch_size_records": p.batch_size,
        "keep_full": p.keep_full,
        "threads": s.threads,
        "eval_batches": p.eval_batches,
    }


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def orchestrate(s: DemoSettings) -> dict[str, Any]:
    """Run the four phases and build the report dict (see the module docstring)."""
    t0 = time.perf_counter()
    p = s.profile
    out = s.out_dir
    env = child_env(s.threads)
    children = _Children()
    target = kill_target(s.seed, p.steps)
    ck_crash, ck_fresh, ck_none = out / "ckpt-killed", out / "ckpt-uninterrupted", out / "none"
    dump_resume, dump_ref = out / "state-recovered.safetensors", out / "state-reference.safetensors"
    res_resumed, res_ref, res_fresh = (
        out / f"result-{n}.json" for n in ("resumed", "reference", "uninterrupted")
    )

    progress = _Progress(total=3 * p.steps, enabled=s.progress)
    try:
        # (a) the run that dies.
        progress.phase("a) train, SIGKILL")

        def kill_when_reached(ev: dict[str, Any]) -> bool:
            progress.event(ev)
            return ev.get("event") == "step" and int(ev["step"]) >= target

        killed = run_child(
            "a-killed", _base_config(s, ck_crash, s.strategy), out, env, children, kill_when_reached
        )
        if killed.killed_at is None:
            _require_ok(killed)
            raise DemoError(f"the first run ended before reaching step {target}")

        # (b) restart on the same directory: resume, dump, finish.
        progress.phase("b) resume, finish")
        cfg = _base_config(s, ck_crash, s.strategy)
        cfg.update(dump_state_at_resume=str(dump_resume), result_path=str(res_resumed))

        def follow_resume(ev: dict[str, Any]) -> bool:
            if ev.get("event") == "resumed":
                # Steps between the recovered one and the kill are trained twice.
                progress.grow(int(killed.killed_at or 0) - int(ev.get("step", 0)))
            progress.event(ev)
            return False

        def follow(ev: dict[str, Any]) -> bool:
            progress.event(ev)
            return False

        resumed_run = run_child("b-resumed", cfg, out, env, children, follow_resume)
        _require_ok(resumed_run)
        resumed = _read_json(res_resumed)
        recovered = int(resumed["start_step"])

        # (c) reference without checkpointing, dumping at the recovered step.
        progress.phase("c) reference (none)")
        cfg = _base_config(s, ck_none, "none")
        cfg.update(
            dump_state_at_step={"step": recovered, "path": str(dump_ref)}, result_path=str(res_ref)
        )
        ref_run = run_child("c-reference", cfg, out, env, children, follow)
        _require_ok(ref_run)
        reference = _read_json(res_ref)

        # (d) uninterrupted lowdiff run, timed against (c); never concurrently with it.
        progress.phase("d) uninterrupted lowdiff")
        cfg = _base_config(s, ck_fresh, s.strategy)
        cfg.update(result_path=str(res_fresh))
        fresh_run = run_child("d-uninterrupted", cfg, out, env, children, follow)
        _require_ok(fresh_run)
        fresh = _read_json(res_fresh)
        # (e) the longest replay the retained files allow, timed in this process
        progress.phase(
            "e) recovery from disk" if s.strategy == "lowdiff+" else "e) worst-case recovery"
        )
        from lowdiff.workloads.train import TrainConfig, probe_recovery

        torch_threads_before = _torch_threads(s.threads)
        try:
            worst = probe_recovery(TrainConfig(**cfg), ck_fresh)
        finally:
            _torch_threads(torch_threads_before)
    finally:
        progress.close()
        children.kill_all()

    state = compare_states(dump_resume, dump_ref)
    state["step"] = recovered
    return {
        "model": {"name": p.model, "n_params": fresh["n_params"]},
        "steps": p.steps,
        "seed": s.seed,
        "strategy": s.strategy,
        "compressor": s.compressor,
        "full_every": p.full_every,
        "batch_size": p.batch_size,
        "keep_full": p.keep_full,
        "train_batch_size": p.train_batch_size,
        "seq_len": p.seq_len,
        "kill": {
            "target_step": target,
            "kill_step": killed.killed_at,
            "durable_at_kill": killed.durable_at_kill,
            "recovered_step": recovered,
            "killed_returncode": killed.returncode,
        },
        "state_check": state,
        "loss": {
            "recovered_final": resumed["final_loss_mean10"],
            "reference_final": reference["final_loss_mean10"],
            "recovered_final_last_step": resumed["final_loss"],
            "reference_final_last_step": reference["final_loss"],
            "recovered_eval": resumed["eval_loss"],
            "reference_eval": reference["eval_loss"],
        },
        "storage": storage_stats(ck_fresh, int(fresh["n_params"]), s.compressor),
        "recovery": resumed["recovery"],
        "recovery_worst_case": worst,
        "overhead": overhead_stats(reference, fresh),
        "trainer_stats": fresh.get("ck_stats"),
        "machine": machine_info(s.threads),
        "out_dir": str(out),
        "wall_s": time.perf_counter() - t0,
    }


def _torch_threads(n: int) -> int:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of ``lowdiff demo``.

    Returns:
        0 if the recovered state is bit-identical to the reference, 1 otherwise
        (including when a phase fails; the reason goes to stderr).
    """
    try:
        settings = resolve_settings(args)
    except ValueError as e:
        print(f"lowdiff demo: {e}", file=sys.stderr)
        return 1
    print(f"lowdiff demo: writing to {settings.out_dir}", file=sys.stderr)
    previous = sigterm_as_interrupt()
    try:
        report = orchestrate(settings)
    except DemoError as e:
        print(f"lowdiff demo: {e}", file=sys.stderr)
        print(f"lowdiff demo: logs kept in {settings.out_dir / 'logs'}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(format_report(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    return 0 if report["state_check"]["bit_identical"] else 1


__all__ = ["add_parser", "run_demo"]
