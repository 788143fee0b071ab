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
  corpus (:func:`lowdiff_lab.workloads.text.eval_batches`), in eval mode;
- ΔModel: the maximum absolute difference over model parameters, and the maximum over
  parameters of ``max|a - b| / max|b|`` (relative); ``torch.equal`` says bit-identical;
- ΔOptim.: the same over every optimizer state tensor (Adam's step, moments);
- KL: ``KL(P_reference || P_recovered)`` of the next-token distributions, float64, mean
  over the held-out positions;
- Top-10: the fraction of positions whose ten most likely next tokens (as a set) agree.

The plan (lengths, settings, cases) is :mod:`lowdiff_lab.bench.fidelity_plan`, the measures
:mod:`lowdiff_lab.bench.fidelity_metrics`, the live runs and the failing child
:mod:`lowdiff_lab.bench.fidelity_runs`, the report section and plot
:mod:`lowdiff_lab.bench.report_fidelity`.

Settings: TopK (ρ of the profile) with error feedback, TopK without error feedback, and
no compression. Error feedback keeps a dense residual that no checkpoint of any strategy
carries: it restarts at zero after recovery (see the README, "Error feedback at
recovery"), so with it on the state at the recovered step is exact and the run after it
may drift; both points are reported as measured. Naive DC is lossy by design (top-k of
the parameter differences); its error is measured like every other.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lowdiff.proc.spawn import spawn_context
from lowdiff_lab.bench.context import QUICK_PROFILE, Context
from lowdiff_lab.bench.core import torch_threads
from lowdiff_lab.bench.fidelity_metrics import (
    OutputStats,
    difference,
    logits_of,
    model_tensors,
    optimizer_tensors,
)
from lowdiff_lab.bench.fidelity_plan import Case, Sizes, plan, sizes_for
from lowdiff_lab.bench.fidelity_runs import (
    Run,
    RunRng,
    failing_child,
    recover,
    reference_run,
    release,
)
from lowdiff_lab.workloads import text, zoo

CAUSAL_LM_FAMILIES = ("gpt2", "qwen3")
"""Zoo families whose model predicts the next token (what the comparison needs)."""

ONE_PER_PROCESS = frozenset({"dcp-async"})
"""Strategies of which a process can hold only one Checkpointer at a time.

``dcp-async``: torch's DCP process saver is a per-process singleton; two async saves of
two Checkpointers in flight at once share its pipe and break it."""

CHILD_TIMEOUT_S = 3600.0
"""How long the training process may take to reach its failure step."""


def fidelity(ctx: Context, sizes: Sizes | None = None) -> list[dict[str, Any]]:
    """Exp. 6: the recovered run against the uninterrupted one, per strategy and setting.

    Args:
        ctx: The bench context (settings, profile, progress, strategies wanted).
        sizes: Lengths of the run; default: :func:`sizes_for` the profile.

    Example:
        >>> ctx = Context(BenchSettings("gpt2-s-tiny"), QUICK_PROFILE)  # doctest: +SKIP
        >>> rows = fidelity(ctx)  # doctest: +SKIP
        >>> from lowdiff_lab.bench.report_fidelity import section_fidelity  # doctest: +SKIP
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
    # Quick: as few killed processes as can be (every process start imports torch and
    # transformers anew); else one (or more) per setting, so that only one setting's
    # model copies are alive at a time.
    if ctx.profile == QUICK_PROFILE:
        groups = _groups([c for cs in cases.values() for c in cs])
    else:
        groups = [g for cs in cases.values() for g in _groups(cs)]
    rows: list[dict[str, Any]] = []
    saved = RunRng.capture()
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
    keys = ", ".join(dict.fromkeys(c.setting.key for c in cases))
    _train_and_kill(ctx, sizes, cases, keys)
    runs: list[Run] = []
    refs: dict[str, Run] = {}
    try:
        for c in cases:
            ctx.progress(f"{c.setting.key}: recovering {c.arm.label}")
            runs.append(recover(s, c))
        for c in cases:
            if c.setting.key not in refs:
                refs[c.setting.key] = reference_run(s, c.setting)
        ctx.progress(
            f"{keys}: training the references and the recovered runs to step {sizes.final_step}"
        )
        rows = _train_on(refs, runs, sizes)
        rows += [_trace_row(r) for r in runs]
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
                release(s, c)


def _train_and_kill(ctx: Context, sizes: Sizes, cases: list[Case], keys: str) -> None:
    """Train ``cases`` in one child process to the failure step, where it dies by SIGKILL.

    Raises:
        RuntimeError: If the child hung, or exited otherwise than killed at its failure
            step; what it left alive is shut down first.
    """
    s, k = ctx.settings, sizes.failure_step
    ctx.progress(f"{keys}: training {len(cases)} runs to step {k} in one process, then SIGKILL")
    proc = spawn_context().Process(
        target=failing_child,
        args=(s.as_dict(), cases, k, torch.get_num_threads()),
        name="lowdiff-fidelity-child",
    )
    proc.start()
    proc.join(CHILD_TIMEOUT_S)
    if proc.exitcode is None:  # hung: end it as the failure it was meant to have
        proc.kill()
        proc.join()
        for c in cases:
            release(s, c)
        raise RuntimeError(
            f"fidelity ({keys}): the training process did not reach step {k} within "
            f"{CHILD_TIMEOUT_S:.0f} s"
        )
    if proc.exitcode != -signal.SIGKILL:
        for c in cases:
            release(s, c)
        raise RuntimeError(
            f"fidelity ({keys}): the training process exited with {proc.exitcode} instead of "
            "being killed at its failure step; its error is printed above"
        )


def _train_on(refs: dict[str, Run], runs: list[Run], sizes: Sizes) -> list[dict[str, Any]]:
    """Train the references from step 0 to the final step, and each recovered run in
    lockstep with its reference from its recovered step on; compare each with its
    reference at its recovered step and at the final step."""
    total = sizes.final_step
    wl = next(iter(refs.values())).workload
    batches = [
        (x.to(wl.device), y.to(wl.device))
        for x, y in text.eval_batches(sizes.eval_batches, wl.batch_size, wl.seq_len or 1)
    ]
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
    return rows


def _trace_row(r: Run) -> dict[str, Any]:
    """ΔModel and the loss difference against the reference after every step trained
    since recovery."""
    assert r.case is not None
    return {
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


def _compare(
    ref: Run,
    runs: Sequence[Run],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    point: str,
    sizes: Sizes,
) -> list[dict[str, Any]]:
    """Rows of ``runs`` against ``ref`` (all at the same step), and ``ref``'s own row."""
    assert ref.case is None and runs and all(r.step == ref.step for r in runs)
    stats = {id(r): OutputStats() for r in runs}
    ref_stats = OutputStats()
    for x, y in batches:
        ref_logits = logits_of(ref.workload.model, x)
        ref_stats.add(ref_logits, ref_logits, y)
        for r in runs:
            stats[id(r)].add(ref_logits, logits_of(r.workload.model, x), y)
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
