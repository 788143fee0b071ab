"""``lowdiff chaos``: every strategy trained through the same failures; where the time went.

Call sequence (the supervising process; every training job is a process of its own)::

    settings = ChaosSettings(quick=True)          # validates every option
    files = run_chaos(settings, out=Path("chaos"))  # results.jsonl, report.md, PNGs

What a run does:

1. starts the launcher (by default a fork server that imports torch once, see
   :mod:`lowdiff.chaos.launch`);
2. runs the reference jobs: strategy ``"none"`` (compressed training, no checkpoint; the
   reference of LowDiff and the baselines) and, when LowDiff+ is compared, the same
   training uncompressed. Their failure-free time ``T_ff`` and step time ``tau`` come from
   here; one reference of each is run again before each block of jobs, and ``T_ff`` is the
   median over them;
3. picks the MTBFs (``--mtbf``, or ``T_ff`` divided by the expected failure counts, 1, 2
   and 4 by default: the paper's 2 h, 1 h, 0.5 h ratio) and, per MTBF, one seeded failure
   schedule shared by every method (:mod:`lowdiff.chaos.schedule`);
4. runs every method through its schedule (:func:`lowdiff.chaos.supervisor.supervise`) and
   splits its time (:func:`lowdiff.chaos.accounting.account`): the comparison of the
   paper's Exp. 3 (wasted time) and Exp. 11 (effective training time ratio);
5. with ``grid``: LowDiff over a grid of ``(f, b)`` under one schedule, against the
   wasted time the paper's model predicts from the costs measured in the same jobs
   (Exp. 8);
6. Exp. 12 (more GPUs) is a *simulation*: each method's measured costs (steady overhead,
   cost per failure) under the system MTBF of N GPUs (``M_8 * 8 / N``, ``M_8`` the
   largest MTBF of the run).

LowDiff's ``(f, b)``: ``"auto"`` hands the MTBF to the Checkpointer (``LOWDIFF_MTBF``),
whose tuner profiles the costs and picks ``(f*, b*)``; ``"model"`` measures the costs in
a profiling job first and takes :func:`lowdiff.plan.optimize` per MTBF; ``"F,B"`` fixes
them.

Every baseline gets its own interval policy too, as its users would run it: CheckFreq
its own profiled interval (``full_every="auto"``); torch.save and DCP async the
Young–Daly interval ``sqrt(2 C M)`` for each MTBF ``M``, with ``C`` the training time one
checkpoint costs, measured in a failure-free profiling job of each
(:func:`young_daly_interval`); ``interval=N`` fixes theirs instead. Gemini (in memory
every step) persists every ``persist_interval`` steps, and Naive DC writes a full
checkpoint every ``persist_interval`` steps.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lowdiff.chaos.accounting import Accounting, account
from lowdiff.chaos.costs import cost_inputs, measured_costs
from lowdiff.chaos.launch import ChaosError, child_env, make_launcher
from lowdiff.chaos.schedule import FailurePoint, FailureSchedule, failure_schedule
from lowdiff.chaos.supervisor import KINDS, Job, JobResult, supervise


@dataclass(frozen=True)
class Method:
    """One compared method: a strategy and the kind of its failures.

    Attributes:
        key: Its name on the command line (``strategy`` or ``strategy:kind``).
        label: Its name in the report.
        strategy: The Checkpointer strategy.
        kind: Failure kind (:data:`lowdiff.chaos.supervisor.KINDS`).
    """

    key: str
    label: str
    strategy: str
    kind: str

    @property
    def uncompressed(self) -> bool:
        """LowDiff+ trains without gradient compression (and is measured against that)."""
        return self.strategy == "lowdiff+"


_LABELS = {
    "lowdiff": "LowDiff",
    "lowdiff+": "LowDiff+",
    "torch-save": "torch.save",
    "checkfreq": "CheckFreq",
    "gemini": "Gemini",
    "naive-dc": "Naive DC",
    "dcp-async": "DCP async",
}
STRATEGIES = tuple(_LABELS)
DEFAULT_METHODS = (
    "lowdiff",
    "lowdiff+",
    "lowdiff+:hardware",
    "torch-save",
    "checkfreq",
    "gemini",
    "naive-dc",
    "dcp-async",
)
"""The quick comparison: LowDiff+ under software and hardware failures, the rest software."""


def parse_method(text: str) -> Method:
    """``STRATEGY`` or ``STRATEGY:KIND`` (kind ``software`` by default).

    Raises:
        ValueError: an unknown strategy or kind, naming it.
    """
    strategy, _, kind = text.strip().partition(":")
    kind = kind or "software"
    if strategy not in _LABELS:
        raise ValueError(
            f"--methods: unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}"
        )
    if kind not in KINDS:
        raise ValueError(
            f"--methods: unknown failure kind {kind!r} in {text!r}; known: software, hardware"
        )
    label = _LABELS[strategy]
    if strategy in ("lowdiff+", "gemini") or kind != "software":
        label += " (S)" if kind == "software" else " (H)"
    key = strategy if kind == "software" else f"{strategy}:{kind}"
    return Method(key=key, label=label, strategy=strategy, kind=kind)


YOUNG_DALY = "young-daly"
"""``interval`` of torch.save and DCP async chosen from the checkpoint cost and the MTBF."""
YOUNG_DALY_STRATEGIES = ("torch-save", "dcp-async")
"""The baselines whose interval the Young–Daly rule picks."""


def young_daly_interval(cost_s: float, mtbf_s: float, tau_s: float) -> int:
    """The Young–Daly checkpoint interval ``sqrt(2 C M)`` in steps of ``tau_s`` (>= 1).

    Args:
        cost_s: Training time one checkpoint costs (seconds, >= 0).
        mtbf_s: Mean time between failures (seconds, > 0).
        tau_s: Time of one training step (seconds, > 0).

    Example:
        >>> young_daly_interval(0.02, 100.0, 0.1)  # sqrt(2 * 0.02 * 100) = 2 s = 20 steps
        20
        >>> young_daly_interval(0.0, 100.0, 0.1)
        1
    """
    for name, v, positive in (
        ("cost_s", cost_s, False),
        ("mtbf_s", mtbf_s, True),
        ("tau_s", tau_s, True),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        if v < 0 or (positive and v == 0):
            raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return max(1, round(math.sqrt(2.0 * cost_s * mtbf_s) / tau_s))


def _lowdiff_auto_supported() -> bool:
    """Whether this lowdiff's Checkpointer takes ``full_every="auto"`` with an MTBF."""
    import inspect

    from lowdiff.engine.checkpointer import LowDiffStrategy

    return "mtbf" in inspect.signature(LowDiffStrategy.__init__).parameters


@dataclass
class ChaosSettings:
    """Everything that defines a chaos run (validated on construction).

    Attributes:
        quick: The small profile: ``gpt2-tiny``, 100 steps (a few minutes on 2 cores).
        grid: Run the ``(f, b)`` grid of LowDiff (Exp. 8) instead of the comparison.
        model: Named model of the training job.
        steps: Steps of every job.
        batch_size: Training sequences per step.
        seq_len: Tokens per sequence.
        threads: Torch threads of each training process (its checkpointing process gets
            the other cores).
        ratio: Top-k ratio of compressed training.
        error_feedback: Top-k error feedback.
        seed: Seed of the failure schedules (the training seed is fixed at 0). The default,
            10, is a seed whose draws give 1, 2 and 4 failures at the default MTBFs, their
            expected counts (common random numbers: one seed stretches the same draws over
            every MTBF); other seeds give other counts.
        mtbfs: MTBFs in seconds of failure-free training; None: ``T_ff / k`` for ``k`` in
            ``expected_failures``.
        expected_failures: Expected failures per job of the default MTBFs.
        methods: Compared methods (:func:`parse_method` keys).
        lowdiff: LowDiff's ``(f, b)``: ``"auto"``, ``"model"`` or ``"F,B"`` (see the
            module docstring); None: ``"auto"`` where the Checkpointer has its tuner, else
            ``"model"``.
        interval: Checkpoint interval of torch.save and DCP async: ``"young-daly"`` (from
            each one's measured checkpoint cost and the MTBF, see the module docstring)
            or a number of steps.
        persist_interval: Gemini's persistence interval and Naive DC's full-checkpoint
            interval (steps).
        grid_f: Full-checkpoint intervals of the grid.
        grid_b: Batch sizes of the grid.
        grid_mtbf: MTBF of the grid; None: ``T_ff / 2``.
        sim_gpus: GPU counts of the Exp. 12 simulation.
        launcher: ``"fork"`` or ``"exec"`` (see :mod:`lowdiff.chaos.launch`).
        workdir: Where the jobs' directories go (None: a temporary directory).
        keep: Keep the jobs' directories (checkpoints and logs) at the end.
        block: Grid jobs between two reference jobs.
    """

    quick: bool = False
    grid: bool = False
    model: str | None = None
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    threads: int = 1
    ratio: float = 0.01
    error_feedback: bool = True
    seed: int = 10
    mtbfs: list[float] | None = None
    expected_failures: tuple[float, ...] = (1.0, 2.0, 4.0)
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    lowdiff: str | None = None
    interval: int | str = YOUNG_DALY
    persist_interval: int = 10
    grid_f: list[int] | None = None
    grid_b: list[int] | None = None
    grid_mtbf: float | None = None
    sim_gpus: tuple[int, ...] = (8, 16, 32, 64)
    launcher: str = "fork"
    workdir: Path | None = None
    keep: bool = False
    block: int = 4

    def __post_init__(self) -> None:
        from lowdiff.chaos.launch import LAUNCHERS
        from lowdiff.workloads.models import MODELS

        self.model = self.model or ("gpt2-tiny" if self.quick else "gpt2-demo")
        if self.model not in MODELS:
            raise ValueError(f"--model: unknown model {self.model!r}; known: {sorted(MODELS)}")
        self.steps = self.steps if self.steps is not None else (100 if self.quick else 300)
        self.batch_size = self.batch_size or (4 if self.quick else 8)
        self.seq_len = self.seq_len or (64 if self.quick else 128)
        if self.interval != YOUNG_DALY and (
            isinstance(self.interval, bool)
            or not isinstance(self.interval, int)
            or self.interval < 1
        ):
            raise ValueError(
                f"--interval must be {YOUNG_DALY!r} or an integer >= 1, got {self.interval!r}"
            )
        for name in ("steps", "batch_size", "seq_len", "threads", "persist_interval", "block"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"--ratio must be in (0, 1], got {self.ratio!r}")
        if self.mtbfs is not None:
            if not self.mtbfs:
                raise ValueError("--mtbf: give at least one MTBF")
            for m in self.mtbfs:
                if not (isinstance(m, (int, float)) and math.isfinite(m) and m > 0):
                    raise ValueError(f"--mtbf must be positive seconds, got {m!r}")
        if self.grid_mtbf is not None and not (
            math.isfinite(self.grid_mtbf) and self.grid_mtbf > 0
        ):
            raise ValueError(f"--grid-mtbf must be positive seconds, got {self.grid_mtbf!r}")
        for k in self.expected_failures:
            if not k > 0:
                raise ValueError(f"expected failures must be > 0, got {k!r}")
        self.parsed_methods = [parse_method(m) for m in self.methods]
        if not self.parsed_methods:
            raise ValueError("--methods: give at least one method")
        keys = [m.key for m in self.parsed_methods]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"--methods: {', '.join(dup)} given twice")
        if self.lowdiff is None:
            self.lowdiff = "auto" if _lowdiff_auto_supported() else "model"
        self.fixed_fb = _parse_fb(self.lowdiff)
        if self.lowdiff == "auto" and not _lowdiff_auto_supported():
            raise ValueError(
                "--lowdiff auto: this lowdiff's Checkpointer has no (f, b) tuner; "
                "use --lowdiff model or --lowdiff F,B"
            )
        self.grid_f = self.grid_f or ([2, 5, 10, 25] if self.quick else [2, 5, 10, 20, 50])
        self.grid_b = self.grid_b or [1, 2, 4]
        for name, vals in (("grid-f", self.grid_f), ("grid-b", self.grid_b)):
            for v in vals:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"--{name} values must be integers >= 1, got {v!r}")
        if not any(b <= f for f in self.grid_f for b in self.grid_b):
            raise ValueError(
                f"--grid-f {self.grid_f} and --grid-b {self.grid_b}: no pair with b <= f"
            )
        for n in self.sim_gpus:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"--sim-gpus values must be integers >= 1, got {n!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(
                f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}"
            )

    def base_config(self) -> dict[str, Any]:
        """Training config keys every job shares."""
        return {
            "model": self.model,
            "seed": 0,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "threads": self.threads,
            "eval_batches": 1,
            "keep_full": 2,
            "compressor": {
                "kind": "topk",
                "ratio": self.ratio,
                "error_feedback": self.error_feedback,
            },
        }

    def describe(self) -> dict[str, Any]:
        """The settings as JSON."""
        out = {k: v for k, v in asdict(self).items() if k not in ("workdir",)}
        out["expected_failures"] = list(self.expected_failures)
        out["sim_gpus"] = list(self.sim_gpus)
        return out


def _parse_fb(text: str) -> tuple[int, int] | None:
    if text in ("auto", "model"):
        return None
    f, sep, b = text.partition(",")
    try:
        fv, bv = int(f), int(b)
    except ValueError:
        fv = bv = 0
    if not sep or fv < 1 or bv < 1 or bv > fv:
        raise ValueError(
            f"--lowdiff must be 'auto', 'model' or 'F,B' with integers 1 <= B <= F, got {text!r}"
        )
    return fv, bv


def method_config(
    m: Method,
    s: ChaosSettings,
    fb: tuple[int, int] | str | None,
    interval: int | None = None,
) -> dict[str, Any]:
    """The training config of a method's job.

    ``fb``: LowDiff's ``(f, b)``, or ``"auto"``. ``interval``: the checkpoint interval of
    torch.save and DCP async (their Young–Daly interval at the job's MTBF); None: the
    fixed ``s.interval``, or ``s.persist_interval`` when that is ``"young-daly"``.
    """
    cfg = s.base_config()
    cfg["strategy"] = m.strategy
    k = s.persist_interval
    if interval is None:
        interval = s.interval if isinstance(s.interval, int) else s.persist_interval
    if m.strategy == "lowdiff":
        if fb == "auto" or fb is None:
            cfg["full_every"], cfg["batch_size_records"] = "auto", "auto"
        else:
            assert not isinstance(fb, str)
            cfg["full_every"], cfg["batch_size_records"] = fb
    elif m.strategy == "lowdiff+":
        cfg["compressor"] = {"kind": "none"}
        cfg["strategy_options"] = {"persist_every": "auto"}
    elif m.strategy == "checkfreq":
        cfg["full_every"] = "auto"  # CheckFreq's own profiled interval
    elif m.strategy == "gemini":
        # an in-memory checkpoint every iteration, persisted every k
        cfg["full_every"] = 1
        cfg["strategy_options"] = {"persist_every": k}
    elif m.strategy == "naive-dc":
        cfg["full_every"] = k
        cfg["strategy_options"] = {"diff_every": 1, "ratio": s.ratio}
    else:  # torch-save, dcp-async
        cfg["full_every"] = interval
    return cfg


# --------------------------------------------------------------------------- the run


@dataclass
class _Reference:
    compressed: bool
    block: int
    result: JobResult
    acc: Accounting


class _Runner:
    def __init__(
        self, s: ChaosSettings, workdir: Path, launcher: Any, progress: Callable[[str], None]
    ) -> None:
        self.s = s
        self.workdir = workdir
        self.launcher = launcher
        self.progress = progress
        self.refs: list[_Reference] = []
        self.jobs_run = 0

    def run(self, job: Job, schedule: FailureSchedule | None) -> JobResult:
        self.jobs_run += 1
        t0 = time.monotonic()
        last = [0]

        def on_event(name: str, ev: dict[str, Any]) -> None:
            if ev.get("event") == "step" and int(ev["step"]) % 25 == 0 and ev["step"] != last[0]:
                last[0] = int(ev["step"])
                self.progress(f"{name}: step {ev['step']}/{self.s.steps}")

        res = supervise(job, schedule, self.launcher, self.workdir, on_event=on_event)
        if not self.s.keep:
            shutil.rmtree(self.workdir / job.name / "ckpt", ignore_errors=True)
        self.progress(
            f"{job.name}: {len(res.attempts) - 1} failure(s), {time.monotonic() - t0:.1f} s"
        )
        return res

    def references(self, block: int, uncompressed: bool) -> None:
        """The reference jobs that open ``block`` (and close the one before)."""
        for compressed in (True, False) if uncompressed else (True,):
            cfg = self.s.base_config()
            cfg["strategy"] = "none"
            if not compressed:
                cfg["compressor"] = {"kind": "none"}
            name = f"ref-{'compressed' if compressed else 'uncompressed'}-{block}"
            res = self.run(Job(name, cfg), None)
            self.refs.append(_Reference(compressed, block, res, account(res.attempts, 0.0)))

    def refs_of(self, compressed: bool, block: int | None = None) -> list[_Reference]:
        return [
            r
            for r in self.refs
            if r.compressed == compressed and (block is None or r.block in (block, block + 1))
        ]

    def t_ff(self, compressed: bool, block: int | None = None) -> tuple[float, float]:
        """``T_ff`` and its startup: the mean of the references that open and close
        ``block`` (the machine's load drifts; these ran nearest to it), or with ``block``
        None the median of all."""
        rs = self.refs_of(compressed, block)
        agg = statistics.median if block is None else statistics.mean
        return agg(r.acc.total_s for r in rs), agg(r.acc.startup_s for r in rs)

    def tau(self, compressed: bool) -> float:
        dts = []
        for r in self.refs_of(compressed):
            a = r.result.attempts[0]
            ts = [a.resumed_t, *(t for _, t in a.steps)]
            dts += [y - x for x, y in zip(ts, ts[1:], strict=False)]
        return statistics.median(dts)


def _step_dts(res: JobResult) -> list[float]:
    a = res.attempts[0]
    ts = [a.resumed_t, *(t for _, t in a.steps)]
    return [y - x for x, y in zip(ts, ts[1:], strict=False)]


def _sig(x: float, digits: int = 3) -> float:
    if x == 0:
        return 0.0
    return round(x, -math.floor(math.log10(abs(x))) + digits - 1)


def _job_row(
    res: JobResult, acc: Accounting, schedule: FailureSchedule, extra: dict[str, Any]
) -> dict[str, Any]:
    st = res.result.get("ck_stats") or {}
    return {
        **extra,
        "job": res.name,
        "mtbf_s": schedule.mtbf_s,
        **acc.as_dict(),
        "failures_scheduled": len(schedule.points),
        "failures_not_injected": res.not_injected,
        "kills": res.kills,
        "leftovers_killed": res.leftovers_killed,
        "final_loss": res.result.get("final_loss"),
        "eval_loss": res.result.get("eval_loss"),
        "ck_stats": st,
    }


def _safe_name(text: str) -> str:
    text = text.replace("+", "plus").replace(":", "-")
    return "".join(c if c.isalnum() or c == "-" else "_" for c in text)


def lowdiff_plan(
    costs: dict[str, Any],
    tau: float,
    t_ff: float,
    mtbf: float,
    f_values: Sequence[int] | None = None,
) -> Any:
    """:func:`lowdiff.plan.optimize` over the model built from measured costs."""
    from lowdiff.plan import CostModel, optimize

    m = CostModel(tau=tau, total_time=t_ff, mtbf=mtbf, **cost_inputs(costs))  # type: ignore[arg-type]
    return optimize(m, f_values=f_values)


def simulate_gpus(
    rows: list[dict[str, Any]], gpus: Sequence[int], base_mtbf: float
) -> list[dict[str, Any]]:
    """Exp. 12 as a simulation from each method's measured costs (see the module docstring).

    Per method, over its jobs of every MTBF: the steady overhead ``o`` (seconds per second
    of failure-free training), the startup overhead ``u`` and the cost of one failure
    ``c`` (lost work plus recovery). With ``N`` GPUs the system MTBF is
    ``M_N = base_mtbf * gpus[0] / N`` and a job of failure-free length ``T`` takes
    ``T (1 + o) + u + (T / M_N) c``; the effective ratio is ``T`` over that.
    """
    out = []
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        rs = [r for r in rows if r["method"] == method]
        t = statistics.mean(r["reference_s"] for r in rs)
        o = statistics.mean(r["overhead_s"] for r in rs) / t
        u = statistics.mean(r["startup_overhead_s"] for r in rs)
        n_fail = sum(r["failures"] for r in rs)
        c = sum(r["lost_work_s"] + r["recovery_s"] for r in rs) / n_fail if n_fail else 0.0
        for n in gpus:
            m_n = base_mtbf * gpus[0] / n
            total = t * (1 + o) + u + (t / m_n) * c
            measured = [r for r in rs if math.isclose(r["mtbf_s"], m_n, rel_tol=0.01)]
            out.append(
                {
                    "experiment": "scale-gpus",
                    "simulation": True,
                    "method": method,
                    "n_gpus": n,
                    "system_mtbf_s": m_n,
                    "steady_overhead_per_s": o,
                    "startup_overhead_s": u,
                    "cost_per_failure_s": c,
                    "failure_free_s": t,
                    "expected_failures": t / m_n,
                    "effective_ratio": t / total,
                    "measured_effective_ratio": measured[0]["effective_ratio"]
                    if measured
                    else None,
                }
            )
    return out


def _best(cells: list[dict[str, Any]], key: str) -> list[int]:
    c = min(cells, key=lambda x: x[key])
    return [c["f"], c["b"]]


def run_chaos(
    s: ChaosSettings, out: Path, progress: Callable[[str], None] | None = None
) -> dict[str, Path]:
    """Run the comparison (or, with ``s.grid``, the grid) and write the report into ``out``.

    Returns:
        The files written, by name (``results``, ``report``, one per figure).

    Raises:
        ChaosError: a training job failed or hung (its logs are kept and named).
    """
    from lowdiff.bench.core import machine_info
    from lowdiff.chaos import report

    say = progress or (lambda _m: None)
    t0 = time.monotonic()
    own_workdir = s.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="lowdiff-chaos-")) if own_workdir else Path(s.workdir)  # type: ignore[arg-type]
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"working in {workdir}")
    env = child_env(s.threads)
    rows: list[dict[str, Any]] = []
    ok = False
    try:
        launcher = make_launcher(s.launcher, env, workdir)
        try:
            r = _Runner(s, workdir, launcher, say)
            uncompressed = any(m.uncompressed for m in s.parsed_methods) and not s.grid
            r.references(0, uncompressed)
            tau = r.tau(True)
            t_ff0, _ = r.t_ff(True)
            info: dict[str, Any] = {
                "launcher": s.launcher,
                "cold_start_s": launcher.preload_s,
                "tau_s": tau,
            }
            if s.grid:
                _grid(s, r, rows, info, tau, t_ff0, say)
            else:
                _compare(s, r, rows, info, tau, t_ff0, uncompressed, say)
        finally:
            launcher.close()
        for ref in r.refs:
            rows.append(
                {
                    "experiment": "reference",
                    "setting": "compressed" if ref.compressed else "uncompressed",
                    "job": ref.result.name,
                    "total_s": ref.acc.total_s,
                    "startup_s": ref.acc.startup_s,
                    "median_step_s": statistics.median(_step_dts(ref.result)),
                }
            )
        for compressed in (True, False):
            if r.refs_of(compressed):
                info[f"t_ff_{'compressed' if compressed else 'uncompressed'}_s"] = r.t_ff(
                    compressed
                )[0]
        run = {
            "machine": machine_info("cpu"),
            "settings": s.describe(),
            "lowdiff_config": s.lowdiff,
            "info": info,
            "wall_s": time.monotonic() - t0,
            "jobs": r.jobs_run,
            "workdir": str(workdir) if s.keep else None,
        }
        files = report.write(out, run, rows)
        ok = True
        return files
    finally:
        if own_workdir and not s.keep and ok:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            say(f"logs kept in {workdir}")


def _compare(
    s: ChaosSettings,
    r: _Runner,
    rows: list[dict[str, Any]],
    info: dict[str, Any],
    tau: float,
    t_ff0: float,
    uncompressed: bool,
    say: Callable[[str], None],
) -> None:
    mtbfs = list(s.mtbfs) if s.mtbfs is not None else [_sig(t_ff0 / k) for k in s.expected_failures]
    mtbfs = sorted(mtbfs, reverse=True)
    assert s.steps is not None
    horizon = s.steps * tau
    schedules = {m: failure_schedule(m, horizon, seed=s.seed, tau_s=tau) for m in mtbfs}
    info["mtbfs_s"] = mtbfs
    info["schedules"] = [sch.as_dict() for sch in schedules.values()]
    for sch in schedules.values():
        rows.append({"experiment": "schedule", **sch.as_dict()})

    fb: dict[float, tuple[int, int] | str] = {}
    costs_rows: list[JobResult] = []
    if any(m.strategy == "lowdiff" for m in s.parsed_methods):
        if s.lowdiff == "auto":
            fb = dict.fromkeys(mtbfs, "auto")
        elif s.fixed_fb is not None:
            fb = dict.fromkeys(mtbfs, s.fixed_fb)
        else:
            prof = _profile_lowdiff(s, r, tau)
            costs_rows.append(prof)
            costs = measured_costs([prof])
            t_ff = r.t_ff(True)[0]
            for m in mtbfs:
                plan = lowdiff_plan(costs, tau, t_ff, m)
                fb[m] = (plan.f, plan.b)
                rows.append(
                    {
                        "experiment": "lowdiff-plan",
                        "mtbf_s": m,
                        "source": "model (costs of the profiling job)",
                        **plan.as_dict(),
                    }
                )
            info["lowdiff_costs"] = costs

    yd = {x.strategy for x in s.parsed_methods} & set(YOUNG_DALY_STRATEGIES)
    intervals: dict[tuple[str, float], int] = {}
    if s.interval == YOUNG_DALY and yd:
        costs_yd: dict[str, float] = {}
        for strategy in sorted(yd):
            prof = _profile_baseline(s, r, strategy)
            st = prof.result.get("ck_stats") or {}
            n = float(st.get("checkpoints") or 0.0)
            if n < 1:
                raise ChaosError(f"the profiling job of {strategy} took no checkpoint")
            costs_yd[strategy] = float(st.get("stall_s") or 0.0) / n
        for m in mtbfs:
            for strategy, c in costs_yd.items():
                k = young_daly_interval(c, m, tau)
                intervals[(strategy, m)] = k
                rows.append(
                    {
                        "experiment": "baseline-interval",
                        "strategy": strategy,
                        "policy": YOUNG_DALY,
                        "checkpoint_cost_s": c,
                        "mtbf_s": m,
                        "tau_s": tau,
                        "interval": k,
                    }
                )
        info["young_daly_costs_s"] = costs_yd

    results: list[tuple[Method, int, float, JobResult]] = []
    for g, m in enumerate(mtbfs):
        if g > 0:
            r.references(g, uncompressed)
        say(f"MTBF {m:g} s: {len(schedules[m].points)} failure(s) scheduled")
        for meth in s.parsed_methods:
            cfg = method_config(meth, s, fb.get(m), intervals.get((meth.strategy, m)))
            job = Job(
                f"mtbf{g}-{_safe_name(meth.key)}",
                cfg,
                kind=meth.kind,
                env={"LOWDIFF_MTBF": repr(float(m))},
            )
            results.append((meth, g, m, r.run(job, schedules[m])))
    r.references(len(mtbfs), uncompressed)

    method_rows = []
    for meth, g, m, res in results:
        ref_total, ref_startup = r.t_ff(not meth.uncompressed, g)
        acc = account(res.attempts, ref_total, ref_startup)
        cfg = method_config(meth, s, fb.get(m), intervals.get((meth.strategy, m)))
        st = res.result.get("ck_stats") or {}
        extra = {
            "experiment": "wasted",
            "method": meth.label,
            "key": meth.key,
            "strategy": meth.strategy,
            "failure_kind": meth.kind,
            "uncompressed": meth.uncompressed,
            "full_every": cfg.get("full_every"),
            "batch_size_records": cfg.get("batch_size_records")
            if meth.strategy == "lowdiff"
            else None,
            "strategy_options": cfg.get("strategy_options", {}),
            "interval_policy": _policy(meth.strategy, s),
            "chosen_full_every": st.get("full_every"),
            "chosen_batch_size": st.get("batch_size"),
        }
        row = _job_row(res, acc, schedules[m], extra)
        method_rows.append(row)
    rows += method_rows
    if method_rows:
        rows += simulate_gpus(method_rows, s.sim_gpus, mtbfs[0])
    lowdiff_jobs = [res for meth, _, _, res in results if meth.strategy == "lowdiff"]
    if lowdiff_jobs or costs_rows:
        info.setdefault("lowdiff_costs", measured_costs(costs_rows + lowdiff_jobs))


def _policy(strategy: str, s: ChaosSettings) -> str:
    """How the method's checkpoint interval was chosen (said in the report)."""
    if strategy == "lowdiff":
        return f"(f, b): {s.lowdiff}"
    if strategy == "lowdiff+":
        return "persist auto"
    if strategy == "checkfreq":
        return "CheckFreq's own (auto)"
    if strategy in YOUNG_DALY_STRATEGIES:
        return "Young–Daly" if s.interval == YOUNG_DALY else "fixed"
    return "fixed"


def _profile_baseline(s: ChaosSettings, r: _Runner, strategy: str) -> JobResult:
    """A failure-free job of ``strategy`` checkpointing every ``persist_interval`` steps
    (few enough that a background save never waits for the previous one): the training
    time one checkpoint costs is its ``stall_s`` per checkpoint."""
    m = parse_method(strategy)
    cfg = method_config(m, s, None, s.persist_interval)
    assert s.steps is not None
    cfg["steps"] = min(s.steps, 4 * s.persist_interval)
    return r.run(Job(f"profile-{strategy}", cfg), None)


def _profile_lowdiff(s: ChaosSettings, r: _Runner, tau: float) -> JobResult:
    """A LowDiff job at (f, b) = (10, 2) with one hardware failure mid-way between two
    full checkpoints: its write and recovery costs feed the model."""
    m = parse_method("lowdiff")
    cfg = method_config(m, s, (10, 2))
    assert s.steps is not None
    step = min(max(15, s.steps // 2 + 5), s.steps - 2)
    sch = FailureSchedule(
        mtbf_s=float("inf"),
        seed=s.seed,
        horizon_s=s.steps * tau,
        tau_s=tau,
        points=(FailurePoint(0, step * tau, step, 0.5),),
    )
    return r.run(Job("profile-lowdiff", cfg, kind="hardware"), sch)


def _grid(
    s: ChaosSettings,
    r: _Runner,
    rows: list[dict[str, Any]],
    info: dict[str, Any],
    tau: float,
    t_ff0: float,
    say: Callable[[str], None],
) -> None:
    from lowdiff.plan import CostModel, wasted_time

    assert s.steps is not None and s.grid_f is not None and s.grid_b is not None
    mtbf = s.grid_mtbf if s.grid_mtbf is not None else _sig(t_ff0 / 2)
    sch = failure_schedule(mtbf, s.steps * tau, seed=s.seed, tau_s=tau)
    info["grid_mtbf_s"] = mtbf
    info["schedules"] = [sch.as_dict()]
    rows.append({"experiment": "schedule", **sch.as_dict()})
    cells = [(f, b) for f in sorted(set(s.grid_f)) for b in sorted(set(s.grid_b)) if b <= f]
    say(f"grid: {len(cells)} cells, MTBF {mtbf:g} s, {len(sch.points)} failure(s) scheduled")
    meth = parse_method("lowdiff")
    done: list[tuple[int, int, JobResult]] = []
    for i, (f, b) in enumerate(cells):
        if i and i % s.block == 0:
            r.references(i // s.block, False)
        cfg = method_config(meth, s, (f, b))
        job = Job(f"grid-f{f}-b{b}", cfg, env={"LOWDIFF_MTBF": repr(float(mtbf))})
        done.append((f, b, r.run(job, sch)))
    r.references(-(-len(cells) // s.block), False)
    ref_total, _ = r.t_ff(True)
    costs = measured_costs([res for _, _, res in done])
    info["lowdiff_costs"] = costs
    inputs = cost_inputs(costs)
    failures = len(sch.points)
    # the model at the failures the jobs actually met (the same for every cell): the
    # predictions are then comparable with the measurements cell by cell
    m_eff = ref_total / failures if failures else mtbf
    model = CostModel(tau=tau, total_time=ref_total, mtbf=m_eff, **inputs)  # type: ignore[arg-type]
    nominal = CostModel(tau=tau, total_time=ref_total, mtbf=mtbf, **inputs)  # type: ignore[arg-type]
    cell_rows = []
    for i, (f, b, res) in enumerate(done):
        acc = account(res.attempts, *r.t_ff(True, i // s.block))
        row = _job_row(
            res,
            acc,
            sch,
            {"experiment": "grid", "method": "LowDiff", "f": f, "b": b},
        )
        row["model_wasted_s"] = wasted_time(model, f, b)
        cell_rows.append(row)
    rows += cell_rows

    def rank_of(key: str, cell: tuple[int, int]) -> int:
        order = sorted(cell_rows, key=lambda x: x[key])
        return 1 + [(x["f"], x["b"]) for x in order].index(cell)

    best = min(cell_rows, key=lambda x: x["model_wasted_s"])
    star = (best["f"], best["b"])
    from lowdiff.plan import optimize

    free = optimize(nominal)
    rows.append(
        {
            "experiment": "grid-summary",
            "mtbf_s": mtbf,
            "failures": failures,
            "model_mtbf_s": m_eff,
            "cost_model": model.as_dict(),
            "f_star": star[0],
            "b_star": star[1],
            "cells": len(cell_rows),
            "rank_core": rank_of("core_wasted_s", star),
            "rank_wasted": rank_of("wasted_s", star),
            "measured_best_core": _best(cell_rows, "core_wasted_s"),
            "measured_best_wasted": _best(cell_rows, "wasted_s"),
            "unconstrained_plan": {"f": free.f, "b": free.b, "wasted_s": free.wasted_s},
        }
    )


__all__ = [
    "DEFAULT_METHODS",
    "STRATEGIES",
    "ChaosError",
    "ChaosSettings",
    "Method",
    "method_config",
    "parse_method",
    "run_chaos",
    "simulate_gpus",
    "young_daly_interval",
]
