"""Exp. 6 of ``lowdiff bench``: does a failure and its recovery change the model?

After the paper's Table "Model performance after checkpoint/recovery". For each
strategy, a language model is trained, killed for real and recovered, and the recovered
run is compared with the same job run without a failure (same weights, data and
dropout), at two points: the recovered step, and the final step after training on.

Call sequence, per setting (one child process per setting):

0) (bench process) plan the cases: every strategy that fits the setting (LowDiff with
   gradient compression, LowDiff+ without, every baseline in both);
1) (child, spawned) build one model copy per case, each with its Checkpointer on its
   own directory, and train them all, step by step in lockstep, to the failure step k;
   each copy draws its dropout masks from RNG states of its own (swapped in around its
   steps), so it trains exactly as it would alone. Then ``flush()`` every Checkpointer
   (the failure strikes once step k's checkpoint is durable, so that every strategy is
   compared at the same step) and SIGKILL the process: no ``close()``, shared memory
   and the checkpointing processes left as a crash leaves them;
2) (bench process) recover every case in fresh objects with ``ck.resume()`` (from disk,
   or from the surviving process's memory for LowDiff+ and Gemini), build the reference
   (the same job, uninterrupted: compressed training without checkpointing, or the plain
   loop), and train the reference from step 0; each recovered case is compared with it
   when the reference reaches its recovered step, then trains on in lockstep with it
   (checkpointing on) to the final step, where all are compared again.

What is compared (recovered run against the reference at the same step):

- perplexity ``exp(mean cross-entropy)`` over fixed held-out batches of the byte
  corpus (:func:`lowdiff.workloads.text.eval_batches`), in eval mode;
- ΔModel: the maximum absolute difference over model parameters, and the maximum over
  parameters of ``max|a - b| / max|b|`` (relative); ``torch.equal`` says bit-identical;
- ΔOptim.: the same over every optimizer state tensor (Adam's step, moments);
- KL: ``KL(P_reference || P_recovered)`` of the next-token distributions, float64, mean
  over the held-out positions;
- Top-10: the fraction of positions whose ten most likely next tokens (as a set) agree.

Settings: TopK (ρ of the profile) with error feedback, TopK without error feedback, and
no compression. Error feedback keeps a dense residual that no checkpoint of any strategy
carries: it restarts at zero after recovery (see the README, "Error feedback at
recovery"), so with it on the state at the recovered step is exact and the run after it
may drift; both points are reported as measured. Naive DC is lossy by design (top-k of
the parameter differences); its error is measured like every other.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import lowdiff
from lowdiff.bench.core import Arm, BenchSettings, build_workload, make_optimizer, torch_threads
from lowdiff.bench.experiments import QUICK_PROFILE, Context, Profile, baseline_arms
from lowdiff.engine.spawn import spawn_context
from lowdiff.workloads import text, zoo

TOP_K = 10
"""Top-k agreement compares the sets of this many most likely next tokens."""

CAUSAL_LM_FAMILIES = ("gpt2", "qwen3")
"""Zoo families whose model predicts the next token (what the comparison needs)."""

QUICK_COMPRESSED_BASELINES = ("torch-save",)
"""Baselines the quick profile runs with gradient compression (all run without)."""

ONE_PER_PROCESS = frozenset({"dcp-async"})
"""Strategies of which a process can hold only one Checkpointer at a time.

``dcp-async``: torch's DCP process saver is a per-process singleton; two async saves of
two Checkpointers in flight at once share its pipe and break it."""

CHUNK_POSITIONS = 2048
"""Held-out positions whose next-token distributions are compared at once."""

IDLE_TIMEOUT_S = 120.0
"""How long a surviving LowDiff+ replica or Gemini holder waits for its new trainer.

Short, so that an experiment stopped between the failure and the recovery leaves no
process behind for long (the default is 300 s)."""


@dataclass(frozen=True)
class Sizes:
    """Lengths of one fidelity run.

    Attributes:
        full_every: Full-checkpoint interval f of LowDiff, LowDiff+ and Naive DC; the
            other baselines checkpoint every step.
        failure_step: Steps completed when the training process is killed (k); best
            between two full checkpoints, so that LowDiff recovers by replaying records.
        final_step: Steps of the whole job; the recovered run trains on to it.
        eval_batches: Held-out batches (of the workload's batch size and sequence length)
            every comparison evaluates.
        lr: Adam learning rate of every run. Higher than the timing experiments' (1e-4), so
            that within a few steps the model leaves its initial, nearly uniform next-token
            distribution, whose top-10 set a rounding error can reorder (gpt2-s-tiny after
            25 steps: perplexity 59 at 1e-3, 178 at 1e-4, of 256 tokens).
    """

    full_every: int
    failure_step: int
    final_step: int
    eval_batches: int
    lr: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("full_every", "failure_step", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(self.lr, float) and self.lr > 0):
            raise ValueError(f"lr must be a positive float, got {self.lr!r}")
        if not isinstance(self.final_step, int) or self.final_step <= self.failure_step:
            raise ValueError(
                f"final_step must be an int > failure_step ({self.failure_step}), "
                f"got {self.final_step!r}"
            )


QUICK_SIZES = Sizes(full_every=10, failure_step=15, final_step=25, eval_batches=4)


def sizes_for(profile: Profile) -> Sizes:
    """The quick sizes for the quick profile; else f from the profile, k = 1.5 f, T = 2.5 f."""
    if profile == QUICK_PROFILE:
        return QUICK_SIZES
    f = profile.lowdiff_full_every
    return Sizes(f, f + f // 2, 2 * f + f // 2, 8)


@dataclass(frozen=True)
class Setting:
    """How the gradients are treated: compressed or not, error feedback on or off.

    Attributes:
        key: Short name in the rows (``"gc-ef"``, ``"gc"``, ``"no-gc"``).
        label: Name in the report.
        ratio: Top-k ratio of the training's compression; None: uncompressed.
        error_feedback: Whether the compressor carries a residual over (compressed only).
    """

    key: str
    label: str
    ratio: float | None
    error_feedback: bool = False

    def compressor(self) -> lowdiff.Compressor | None:
        if self.ratio is None:
            return None
        return lowdiff.TopK(ratio=self.ratio, error_feedback=self.error_feedback)


def settings_for(profile: Profile) -> list[Setting]:
    r = profile.ratio
    return [
        Setting("gc-ef", f"w/ GC (TopK ρ={r:g}), error feedback on", r, True),
        Setting("gc", f"w/ GC (TopK ρ={r:g}), error feedback off", r, False),
        Setting("no-gc", "w/o GC", None),
    ]


@dataclass(frozen=True)
class Case:
    """One strategy in one setting: what the child trains and the bench process recovers."""

    setting: Setting
    arm: Arm
    directory: str


def plan(ctx: Context, sizes: Sizes, root: Path) -> dict[str, list[Case]]:
    """Cases by setting key: LowDiff (compressed), LowDiff+ (uncompressed), the baselines.

    The quick profile runs every baseline without compression only; with compression it
    runs torch.save (no process of its own to start), which shows what error feedback
    does to any strategy. Every other strategy costs two process starts (seconds each).
    """
    p = replace(ctx.profile, lowdiff_full_every=sizes.full_every)
    quick = ctx.profile == QUICK_PROFILE
    out: dict[str, list[Case]] = {}
    for s in settings_for(ctx.profile):
        arms: list[Arm] = []
        if s.ratio is not None:
            arms.append(
                Arm(
                    "LowDiff",
                    "lowdiff",
                    s.ratio,
                    p.lowdiff_full_every,
                    (("batch_size", p.lowdiff_batch),),
                )
            )
        else:
            arms.append(
                Arm(
                    "LowDiff+",
                    "lowdiff+",
                    None,
                    p.lowdiff_full_every,
                    (("persist_every", "auto"), ("idle_timeout", IDLE_TIMEOUT_S)),
                )
            )
        for a in baseline_arms(p, s.ratio, None):
            if not quick or s.ratio is None or a.strategy in QUICK_COMPRESSED_BASELINES:
                if a.strategy == "gemini":
                    a = replace(a, options=(*a.options, ("idle_timeout", IDLE_TIMEOUT_S)))
                arms.append(a)
        cases = [
            Case(s, a, str(root / f"{s.key}-{i:02d}-{a.strategy}"))
            for i, a in enumerate(arms)
            if ctx.wants(a.strategy)
        ]
        if cases:
            out[s.key] = cases
    return out


# --------------------------------------------------------------------------- metrics


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """``exp`` of the mean next-token cross-entropy (in float64) of ``logits`` (..., V).

    Example:
        >>> perplexity(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]]))  # uniform over 4
        4.0
    """
    lp = torch.log_softmax(logits.detach().to(torch.float64).flatten(0, -2), dim=-1)
    ce = F.nll_loss(lp, targets.flatten(), reduction="mean")
    return math.exp(float(ce))


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``KL(P_ref || P)`` per position of two next-token logit tensors (..., V), float64.

    Identical logits give exactly 0.

    Example:
        >>> p = torch.zeros(1, 2, dtype=torch.float64)  # (1/2, 1/2)
        >>> q = torch.tensor([[0.25, 0.75]], dtype=torch.float64).log()
        >>> round(float(kl_divergence(p, q)[0]), 6)  # 1/2 ln 2 + 1/2 ln(2/3)
        0.143841
    """
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    lp_ref = torch.log_softmax(ref_logits.detach().to(torch.float64), dim=-1)
    lp = torch.log_softmax(logits.detach().to(torch.float64), dim=-1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(dim=-1)


def top_k_agreement(ref_logits: torch.Tensor, logits: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """Per position: whether the ``k`` most likely tokens of both are the same set.

    Example:
        >>> ref = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
        >>> top_k_agreement(ref, torch.tensor([[3.0, 4.0, 1.0, 2.0]]), k=2)  # same two
        tensor([True])
    """
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    k = min(k, logits.shape[-1])
    a = torch.topk(ref_logits.detach(), k, dim=-1).indices.sort(dim=-1).values
    b = torch.topk(logits.detach(), k, dim=-1).indices.sort(dim=-1).values
    return (a == b).all(dim=-1)


@dataclass
class Difference:
    """How far apart two sets of named tensors are.

    Attributes:
        max_abs: ``max |a - b|`` over every element of every tensor.
        max_rel: Largest per-tensor ``max|a - b| / max|b|`` (the denominator at least the
            dtype's smallest normal number).
        identical: Every pair ``torch.equal`` (dtype and shape included).
        worst: Name of the tensor with the largest absolute difference (None if all 0).
    """

    max_abs: float
    max_rel: float
    identical: bool
    worst: str | None = None


def difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> Difference:
    """Compare tensors by name (``b`` is the reference).

    Example:
        >>> d = difference({"w": torch.tensor([1.0, 2.5])}, {"w": torch.tensor([1.0, 2.0])})
        >>> d.max_abs, d.max_rel, d.identical
        (0.5, 0.25, False)

    Raises:
        ValueError: If the names differ, or a pair differs in shape.
    """
    if set(a) != set(b):
        raise ValueError(
            f"tensor names differ: only in the first {sorted(set(a) - set(b))[:5]}, "
            f"only in the reference {sorted(set(b) - set(a))[:5]}"
        )
    out = Difference(0.0, 0.0, True)
    for name in sorted(a):
        x, y = a[name].detach(), b[name].detach()
        if x.shape != y.shape:
            raise ValueError(f"tensor {name!r}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        out.identical = out.identical and x.dtype == y.dtype and torch.equal(x, y)
        if x.numel() == 0:
            continue
        d = float((x.to(torch.float64) - y.to(torch.float64).to(x.device)).abs().max())
        scale = float(y.to(torch.float64).abs().max())
        tiny = torch.finfo(y.dtype).tiny if y.is_floating_point() else 1.0
        if d > out.max_abs:
            out.max_abs, out.worst = d, name
        out.max_rel = max(out.max_rel, d / max(scale, tiny))
    return out


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name (tied weights once)."""
    return {n: p for n, p in model.named_parameters()}


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's per-parameter state, as ``"{index}.{name}"``."""
    out: dict[str, torch.Tensor] = {}
    for idx, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{idx}.{name}"] = v
    return out


@dataclass
class _OutputStats:
    """Sums over the held-out positions of one model against the reference."""

    positions: int = 0
    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        flat, ref, tgt = logits.flatten(0, -2), ref_logits.flatten(0, -2), targets.flatten()
        # in chunks: float64 copies of (positions x 50k-150k vocabulary) add up to gigabytes
        for i in range(0, flat.shape[0], CHUNK_POSITIONS):
            a, b = flat[i : i + CHUNK_POSITIONS], ref[i : i + CHUNK_POSITIONS]
            lp = torch.log_softmax(a.to(torch.float64), dim=-1)
            self.nll += float(F.nll_loss(lp, tgt[i : i + CHUNK_POSITIONS], reduction="sum"))
            self.kl += float(kl_divergence(b, a).sum())
            self.agree += int(top_k_agreement(b, a).sum())
        self.positions += flat.shape[0]

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.positions)


@torch.no_grad()
def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    was = model.training
    model.eval()
    try:
        return model(input_ids=x, use_cache=False).logits.float()  # type: ignore[no-any-return]
    finally:
        model.train(was)


# --------------------------------------------------------------------------- live runs


@dataclass
class _Rng:
    """A run's own random streams, swapped into the process around its steps."""

    torch_state: torch.Tensor
    python: Any
    numpy: Any
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls) -> _Rng:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda)

    def install(self) -> None:
        torch.set_rng_state(self.torch_state)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


@dataclass
class _Run:
    """One training job alive in this process: a case, or the reference."""

    label: str
    workload: zoo.Workload
    optimizer: torch.optim.Optimizer
    ck: Any
    rng: _Rng
    step: int = 0
    case: Case | None = None
    recovery: dict[str, Any] = field(default_factory=dict)
    measured: bool = False
    trace: dict[str, list[Any]] = field(
        default_factory=lambda: {"step": [], "model_max_abs_diff": [], "loss_abs_diff": []}
    )

    @property
    def case_key(self) -> str:
        """The setting key of the case ("" for a reference)."""
        return "" if self.case is None else self.case.setting.key

    def train_step(self) -> float:
        """One optimizer step on this run's own random streams; returns the loss."""
        self.rng.install()
        loss = self.workload.forward_backward(self.step)
        if self.ck is None:
            self.optimizer.step()
        else:
            self.ck.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.rng = _Rng.capture()
        self.step += 1
        return loss

    def record(self, ref: _Run, loss_diff: float | None) -> None:
        """Add ΔModel against ``ref`` (at the same step) to the trace."""
        d = difference(model_tensors(self.workload.model), model_tensors(ref.workload.model))
        self.trace["step"].append(self.step)
        self.trace["model_max_abs_diff"].append(d.max_abs)
        self.trace["loss_abs_diff"].append(loss_diff)

    def close(self) -> None:
        if self.ck is not None:
            ck, self.ck = self.ck, None
            ck.close()


def _checkpointer(
    case: Case, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Any:  # lowdiff.Checkpointer or a baseline
    a = case.arm
    return lowdiff.Checkpointer(
        model,
        opt,
        case.directory,
        strategy=a.strategy or "none",
        compressor=None if a.strategy == "lowdiff+" else case.setting.compressor(),
        full_every=a.full_every,
        **dict(a.options),
    )


def _reference(s: BenchSettings, setting: Setting) -> _Run:
    """The uninterrupted job: compressed training without checkpoints, or the plain loop."""
    wl = build_workload(s)
    opt = make_optimizer(wl.model, s.lr)
    ck = None
    if setting.ratio is not None:
        ck = lowdiff.Checkpointer(
            wl.model, opt, None, strategy="none", compressor=setting.compressor()
        )
        ck.resume()
    return _Run("Baseline", wl, opt, ck, _Rng.capture())


def _settings_dict(s: BenchSettings) -> dict[str, Any]:
    return {**asdict(s), "workdir": str(s.workdir)}


CHILD_TIMEOUT_S = 3600.0
"""How long the training process may take to reach its failure step."""

CHILD_ERROR_EXIT = 3
"""Exit status of a failing-process child that raised before its failure step."""


def _failing_child(settings: dict[str, Any], cases: list[Case], steps: int, threads: int) -> None:
    """(child) Train every case in lockstep to ``steps``, make it durable, die by SIGKILL."""
    try:
        torch.set_num_threads(threads)
        s = BenchSettings(**{**settings, "workdir": Path(settings["workdir"])})
        runs: list[_Run] = []
        for c in cases:
            wl = build_workload(s)  # seeds the global RNG: the weights and dropout of every run
            opt = make_optimizer(wl.model, s.lr)
            ck = _checkpointer(c, wl.model, opt)
            if ck.resume() != 0:
                raise RuntimeError(f"{c.directory} was not empty")
            runs.append(_Run(c.arm.label, wl, opt, ck, _Rng.capture(), case=c))
        for _ in range(steps):
            for r in runs:
                r.train_step()
        for r in runs:
            r.ck.flush()
    except BaseException:
        # A normal exit would first wait for the checkpointing processes this process
        # started, which wait for it: report the error and leave at once instead.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(CHILD_ERROR_EXIT)
    os.kill(os.getpid(), signal.SIGKILL)


def _recover(s: BenchSettings, case: Case) -> _Run:
    wl = build_workload(s)
    opt = make_optimizer(wl.model, s.lr)
    t0 = time.perf_counter()
    ck = _checkpointer(case, wl.model, opt)
    step = ck.resume()
    resume_s = time.perf_counter() - t0
    rs = ck.recovery_stats
    rec = {
        "recovered_step": step,
        "resume_s": resume_s,
        "recovery_source": getattr(rs, "source", None),
        "records_replayed": getattr(rs, "records_replayed", None),
        "recovery_full_step": getattr(rs, "full_step", None),
    }
    return _Run(case.arm.label, wl, opt, ck, _Rng.capture(), step=step, case=case, recovery=rec)


# --------------------------------------------------------------------------- experiment


def fidelity(ctx: Context, sizes: Sizes | None = None) -> list[dict[str, Any]]:
    """Exp. 6: the recovered run against the uninterrupted one, per strategy and setting.

    Args:
        ctx: The bench context (settings, profile, progress, strategies wanted).
        sizes: Lengths of the run; default: :func:`sizes_for` the profile.

    Example:
        >>> ctx = Context(BenchSettings("gpt2-s-tiny"), QUICK_PROFILE)  # doctest: +SKIP
        >>> rows = fidelity(ctx)  # doctest: +SKIP
        >>> print(section_fidelity(rows))  # doctest: +SKIP

    Returns:
        Per setting: at the recovered and at the final step, a ``"Baseline"`` row (the
        reference's perplexity) and one row per strategy (``point`` ``"recovered"`` /
        ``"final"``); and one ``"trace"`` row per strategy with ΔModel after every step
        trained after recovery. A workload that is not a causal LM gives one row with
        ``"skipped"``.
    """
    s = ctx.settings
    spec = zoo.WORKLOADS.get(s.workload)
    if spec is None or spec.family not in CAUSAL_LM_FAMILIES:
        family = None if spec is None else spec.family
        return [
            {
                "experiment": "fidelity",
                "skipped": f"workload {s.workload!r} (family {family}) is not a causal language "
                f"model; fidelity needs one of the families {list(CAUSAL_LM_FAMILIES)}",
            }
        ]
    sizes = sizes or sizes_for(ctx.profile)
    ctx = replace(ctx, settings=replace(s, lr=sizes.lr))
    root = Path(s.workdir) / f"lowdiff-bench-fidelity-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cases = plan(ctx, sizes, root)
    # Quick: as few killed processes as can be (a process start imports torch and
    # transformers, seconds each); else one (or more) per setting, so that only one
    # setting's model copies are alive at a time.
    if ctx.profile == QUICK_PROFILE:
        groups = _groups([c for cs in cases.values() for c in cs])
    else:
        groups = [g for cs in cases.values() for g in _groups(cs)]
    rows: list[dict[str, Any]] = []
    saved = _Rng.capture()
    # The reference and the recovered runs must compute with the same thread count as the
    # killed process; one thread on a CPU keeps the checkpointing processes of several
    # strategies from fighting the training for the cores (nothing here is timed).
    threads = 1 if s.device == "cpu" else torch.get_num_threads()
    try:
        with torch_threads(threads):
            for group in groups:
                if group:
                    rows += _group(ctx, sizes, group)
    finally:
        saved.install()
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _groups(cases: list[Case]) -> list[list[Case]]:
    """Cases packed in order into as few groups (processes) as :data:`ONE_PER_PROCESS` allows."""
    groups: list[list[Case]] = []
    for c in cases:
        for g in groups:
            if c.arm.strategy not in ONE_PER_PROCESS or all(
                d.arm.strategy != c.arm.strategy for d in g
            ):
                g.append(c)
                break
        else:
            groups.append([c])
    return groups


def _group(ctx: Context, sizes: Sizes, cases: list[Case]) -> list[dict[str, Any]]:
    """Kill one process that trained ``cases``, recover each, compare with the references."""
    s = ctx.settings
    k, total = sizes.failure_step, sizes.final_step
    keys = ", ".join(dict.fromkeys(c.setting.key for c in cases))
    ctx.progress(f"{keys}: training {len(cases)} runs to step {k} in one process, then SIGKILL")
    proc = spawn_context().Process(
        target=_failing_child,
        args=(_settings_dict(s), cases, k, torch.get_num_threads()),
        name="lowdiff-fidelity-child",
    )
    proc.start()
    proc.join(CHILD_TIMEOUT_S)
    if proc.exitcode is None:  # hung: end it as the failure it was meant to have
        proc.kill()
        proc.join()
        for c in cases:
            _release(s, c)
        raise RuntimeError(
            f"fidelity ({keys}): the training process did not reach step {k} within "
            f"{CHILD_TIMEOUT_S:.0f} s"
        )
    if proc.exitcode != -signal.SIGKILL:
        for c in cases:
            _release(s, c)
        raise RuntimeError(
            f"fidelity ({keys}): the training process exited with {proc.exitcode} instead of "
            "being killed at its failure step; its error is printed above"
        )
    runs: list[_Run] = []
    refs: dict[str, _Run] = {}
    try:
        for c in cases:
            ctx.progress(f"{c.setting.key}: recovering {c.arm.label}")
            runs.append(_recover(s, c))
        for c in cases:
            if c.setting.key not in refs:
                refs[c.setting.key] = _reference(s, c.setting)
        wl = next(iter(refs.values())).workload
        batches = [
            (x.to(wl.device), y.to(wl.device))
            for x, y in text.eval_batches(sizes.eval_batches, wl.batch_size, wl.seq_len or 1)
        ]
        ctx.progress(f"{keys}: training the references and the recovered runs to step {total}")
        rows: list[dict[str, Any]] = []
        for t in range(total + 1):
            for key, ref in refs.items():
                due = [r for r in runs if r.case_key == key and r.step == t and not r.measured]
                if due:
                    rows += _compare(ref, due, batches, "recovered", sizes)
                    for r in due:
                        r.measured = True
                        r.record(ref, None)
            if t == total:
                break
            losses = {key: ref.train_step() for key, ref in refs.items()}
            for r in runs:
                if r.measured and r.step == t:
                    r.record(refs[r.case_key], abs(r.train_step() - losses[r.case_key]))
        for key, ref in refs.items():
            rows += _compare(ref, [r for r in runs if r.case_key == key], batches, "final", sizes)
        for r in runs:
            assert r.case is not None
            rows.append(
                {
                    "experiment": "fidelity",
                    "point": "trace",
                    "setting": r.case_key,
                    "setting_label": r.case.setting.label,
                    "method": r.label,
                    "strategy": r.case.arm.strategy,
                    "trace_steps": r.trace["step"],
                    "trace_model_max_abs_diff": r.trace["model_max_abs_diff"],
                    "trace_loss_abs_diff": r.trace["loss_abs_diff"],
                }
            )
        for r in runs:
            r.close()
        return rows
    finally:
        for r in [*runs, *refs.values()]:
            with contextlib.suppress(Exception):
                r.close()
        recovered = {r.case.directory for r in runs if r.case is not None}
        for c in cases:
            if c.directory not in recovered:
                _release(s, c)


def _release(s: BenchSettings, case: Case) -> None:
    """Attach to what a killed child left alive (a replica, a holder) and shut it down."""
    with contextlib.suppress(Exception):
        _recover(s, case).close()


def _compare(
    ref: _Run,
    runs: Sequence[_Run],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    point: str,
    sizes: Sizes,
) -> list[dict[str, Any]]:
    """Rows of ``runs`` against ``ref`` (all at the same step), and ``ref``'s own row."""
    assert ref.case is None and runs and all(r.step == ref.step for r in runs)
    stats = {id(r): _OutputStats() for r in runs}
    ref_stats = _OutputStats()
    for x, y in batches:
        ref_logits = _logits(ref.workload.model, x)
        ref_stats.add(ref_logits, ref_logits, y)
        for r in runs:
            stats[id(r)].add(ref_logits, _logits(r.workload.model, x), y)
    setting = runs[0].case.setting if runs[0].case is not None else None
    assert setting is not None
    common = {
        "experiment": "fidelity",
        "point": point,
        "step": ref.step,
        "failure_step": sizes.failure_step,
        "final_step": sizes.final_step,
        "full_every": sizes.full_every,
        "lr": sizes.lr,
        "workload": ref.workload.name,
        "setting": setting.key,
        "setting_label": setting.label,
        "eval_positions": ref_stats.positions,
    }
    rows: list[dict[str, Any]] = [
        {**common, "method": "Baseline", "reference": True, "ppl": ref_stats.ppl}
    ]
    ref_model, ref_opt = model_tensors(ref.workload.model), optimizer_tensors(ref.optimizer)
    for r in runs:
        assert r.case is not None
        st = stats[id(r)]
        dm = difference(model_tensors(r.workload.model), ref_model)
        do = difference(optimizer_tensors(r.optimizer), ref_opt)
        rows.append(
            {
                **common,
                "method": r.label,
                "strategy": r.case.arm.strategy,
                "reference": False,
                "ppl": st.ppl,
                "reference_ppl": ref_stats.ppl,
                "model_max_abs_diff": dm.max_abs,
                "model_max_rel_diff": dm.max_rel,
                "model_bit_identical": dm.identical,
                "model_worst_tensor": dm.worst,
                "optim_max_abs_diff": do.max_abs,
                "optim_max_rel_diff": do.max_rel,
                "optim_bit_identical": do.identical,
                "optim_worst_tensor": do.worst,
                "kl": st.kl / st.positions,
                "top10_agreement": st.agree / st.positions,
                **r.recovery,
            }
        )
    return rows


# --------------------------------------------------------------------------- report


def _num(x: float | None) -> str:
    if x is None:
        return "n/a"
    return "0" if x == 0 else f"{x:.1e}"


def _diff_cell(r: dict[str, Any], what: str) -> str:
    a, rel = r.get(f"{what}_max_abs_diff"), r.get(f"{what}_max_rel_diff")
    if a is None:
        return "n/a"
    return "0" if a == 0 else f"{a:.1e} (rel. {rel:.1e})"


def section_fidelity(rows: list[dict[str, Any]]) -> str:
    """Markdown in the layout of the paper's Table "Model performance after checkpoint/recovery".

    One table at the recovered step and one at the final step; rows grouped by setting,
    each group led by its Baseline (the uninterrupted run). Empty without fidelity rows.

    Example:
        >>> section_fidelity([])
        ''
    """
    from lowdiff.bench.report import table  # report may import this module

    fid = [r for r in rows if r.get("experiment") == "fidelity"]
    if not fid:
        return ""
    out = ["## Fidelity after recovery (Exp. 6)", ""]
    skipped = [r["skipped"] for r in fid if "skipped" in r]
    if skipped:
        return "\n".join([*out, f"Not run: {skipped[0]}."])
    measured = [r for r in fid if r.get("point") in ("recovered", "final")]
    if not measured:
        return ""
    m0 = measured[0]
    out += [
        f"{m0['workload']}, Adam lr {m0['lr']:g}. "
        f"The training process is SIGKILLed after step {m0['failure_step']} (once its checkpoint "
        f"is durable), recovered with `resume()` in fresh objects, and trained on to step "
        f"{m0['final_step']}; each row compares it with the same job run without a failure "
        f"(Baseline: same weights, data and dropout). PPL on {m0['eval_positions']} held-out "
        "positions; ΔModel / ΔOptim.: largest absolute difference over model parameters / "
        "optimizer state (relative: largest per-tensor max|a−b| / max|b|); KL: KL(baseline ‖ "
        "recovered) of the next-token distributions, mean over positions; Top-10: positions "
        f"whose 10 most likely tokens agree. LowDiff, LowDiff+ and Naive DC take a full "
        f"checkpoint every {m0['full_every']} steps, the other baselines every step. GC: "
        "gradient compression.",
    ]
    for point, title in (
        ("recovered", "At the recovered step"),
        ("final", "At the final step, after training on"),
    ):
        rs = [r for r in measured if r["point"] == point]
        if not rs:
            continue
        body: list[list[str]] = []
        for key in dict.fromkeys(r["setting"] for r in rs):
            group = [r for r in rs if r["setting"] == key]
            body.append([f"*{group[0]['setting_label']}*", "", "", "", "", ""])
            for r in group:
                if r.get("reference"):
                    body.append(
                        [f"Baseline (step {r['step']})", f"{r['ppl']:.2f}", "–", "–", "–", "–"]
                    )
                    continue
                step = (
                    ""
                    if r["step"] == r["failure_step"] or point == "final"
                    else f" (step {r['step']})"
                )
                body.append(
                    [
                        r["method"] + step,
                        f"{r['ppl']:.2f}",
                        _diff_cell(r, "model"),
                        _diff_cell(r, "optim"),
                        _num(r["kl"]),
                        "100%"
                        if r["top10_agreement"] == 1
                        else f"{100 * r['top10_agreement']:.1f}%",
                    ]
                )
        out += ["", f"### {title}", ""]
        out.append(table(["Method", "PPL", "ΔModel", "ΔOptim.", "KL", "Top-10"], body))

    def names(point: str, exact: bool) -> str:
        got = sorted(
            {
                f"{r['method']} ({r['setting']})"
                for r in measured
                if r["point"] == point
                and not r.get("reference")
                and (r["model_bit_identical"] and r["optim_bit_identical"]) == exact
            }
        )
        return ", ".join(got) or "none"

    out += [
        "",
        "Model and optimizer state bit-identical (`torch.equal`) to the baseline at the "
        f"recovered step: {names('recovered', True)}; not: {names('recovered', False)}. "
        f"Still bit-identical at the final step: {names('final', True)}. With error feedback "
        "on, every strategy restarts the residual at zero after recovery (no checkpoint "
        "carries it), so the run after recovery can drift from the baseline although the "
        "recovered state is exact.",
    ]
    return "\n".join(out)


def plot_fidelity(out_dir: Path, rows: list[dict[str, Any]]) -> Path | None:
    """``fidelity.png``: ΔModel against the step after recovery, one panel per setting.

    Returns:
        The file written, or None without trace rows.

    Example:
        >>> plot_fidelity(Path("results"), []) is None
        True
    """
    traces = [r for r in rows if r.get("experiment") == "fidelity" and r.get("point") == "trace"]
    if not traces:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(r["setting"] for r in traces))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    markers = "os^vDx*+"
    for ax, key in zip(axes[0], keys, strict=True):
        group = [r for r in traces if r["setting"] == key]
        top = 0.0
        for i, r in enumerate(group):
            ys = r["trace_model_max_abs_diff"]
            top = max(top, *ys) if ys else top
            # identical curves (every exact strategy) stay visible: markers and dashes differ
            ax.plot(
                r["trace_steps"],
                ys,
                marker=markers[i % len(markers)],
                ms=4,
                linestyle=("-", "--", ":", "-.")[i % 4],
                alpha=0.8,
                label=r["method"],
            )
        ax.set_yscale("symlog", linthresh=1e-9)
        ax.set_ylim(bottom=0, top=max(1e-6, 3 * top))
        ax.set_xlabel("step (first point: the recovered step)")
        ax.set_ylabel("ΔModel: max |recovered − baseline|")
        ax.set_title(group[0]["setting_label"], fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Exp. 6: fidelity after recovery")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "fidelity.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
