"""What a chaos run compares and how: the methods, the settings, each job's training config.

Call sequence::

    settings = ChaosSettings(quick=True)          # validates every option, names the bad one
    method = settings.parsed_methods[0]           # Method: strategy and failure kind
    config = method_config(method, settings, fb)  # the training config of one job

LowDiff's ``(f, b)``: ``"auto"`` (the default) hands the MTBF to the Checkpointer
(``LOWDIFF_MTBF``), whose tuner profiles the costs and picks ``(f*, b*)``; ``"model"``
measures the costs in a profiling job first and takes :func:`lowdiff.plan.optimize` per
MTBF; ``"F,B"`` fixes them.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lowdiff.plan import young_daly_s
from lowdiff_lab.chaos.launch import LAUNCHERS
from lowdiff_lab.chaos.supervisor import KINDS
from lowdiff_lab.workloads.models import MODELS


@dataclass(frozen=True)
class Method:
    """One compared method: a strategy and the kind of its failures.

    Attributes:
        key: Its name on the command line (``strategy`` or ``strategy:kind``).
        label: Its name in the report.
        strategy: The Checkpointer strategy.
        kind: Failure kind (:data:`lowdiff_lab.chaos.supervisor.KINDS`).
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
    if isinstance(tau_s, bool) or not isinstance(tau_s, (int, float)) or not tau_s > 0:
        raise ValueError(f"tau_s must be a finite number > 0, got {tau_s!r}")
    if not math.isfinite(tau_s):
        raise ValueError(f"tau_s must be a finite number, got {tau_s!r}")
    return max(1, round(young_daly_s(cost_s, mtbf_s) / tau_s))


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
            module docstring); None: ``"auto"``.
        interval: Checkpoint interval of torch.save and DCP async: ``"young-daly"`` (from
            each one's measured checkpoint cost and the MTBF, see the module docstring)
            or a number of steps.
        persist_interval: Gemini's persistence interval and Naive DC's full-checkpoint
            interval (steps).
        grid_f: Full-checkpoint intervals of the grid.
        grid_b: Batch sizes of the grid.
        grid_mtbf: MTBF of the grid; None: ``T_ff / 2``.
        sim_gpus: GPU counts of the Exp. 12 simulation.
        launcher: ``"fork"`` or ``"exec"`` (see :mod:`lowdiff_lab.chaos.launch`).
        workdir: Where the jobs' directories go (None: a temporary directory).
        keep: Keep the jobs' directories (checkpoints and logs) at the end.
        block: Grid jobs between two reference jobs.
        rounds: Times every method runs through every schedule (the comparison, not the
            grid). Each round is a block per MTBF, between reference jobs of its own; the
            report gives each cell's median over the rounds and their range, since one
            job of a second moves by several points with the load of the machine.
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
    rounds: int = 1

    def __post_init__(self) -> None:
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
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "threads",
            "persist_interval",
            "block",
            "rounds",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.grid and self.rounds > 1:
            raise ValueError("--rounds repeats the comparison; --grid runs each cell once")
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
            self.lowdiff = "auto"
        self.fixed_fb = _parse_fb(self.lowdiff)
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


__all__ = [
    "DEFAULT_METHODS",
    "STRATEGIES",
    "YOUNG_DALY",
    "YOUNG_DALY_STRATEGIES",
    "ChaosSettings",
    "Method",
    "method_config",
    "parse_method",
    "young_daly_interval",
]
