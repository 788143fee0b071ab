"""Exp. 6 (fidelity after recovery): the metrics on constructed inputs, and one real run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lowdiff_lab.bench.core import Arm, BenchSettings
from lowdiff_lab.bench.experiments import QUICK_PROFILE, Context
from lowdiff_lab.bench.fidelity import _groups, fidelity
from lowdiff_lab.bench.fidelity_metrics import (
    difference,
    kl_divergence,
    perplexity,
    top_k_agreement,
)
from lowdiff_lab.bench.fidelity_plan import Case, Setting, Sizes, plan
from lowdiff_lab.bench.report_fidelity import plot_fidelity, section_fidelity

# --------------------------------------------------------------------------- metrics


def test_kl_of_identical_distributions_is_exactly_zero() -> None:
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0))
    kl = kl_divergence(logits, logits.clone())
    assert kl.shape == (3, 7)
    assert torch.equal(kl, torch.zeros_like(kl))


def test_kl_matches_a_hand_value() -> None:
    # P = (1/2, 1/2), Q = (1/4, 3/4): KL(P || Q) = 1/2 ln 2 + 1/2 ln(2/3)
    p = torch.zeros(1, 2, dtype=torch.float64)
    q = torch.tensor([[math.log(0.25), math.log(0.75)]], dtype=torch.float64)
    want = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    assert float(kl_divergence(p, q)[0]) == pytest.approx(want, rel=1e-12)
    # and it is not symmetric: KL(Q || P) = 1/4 ln(1/2) + 3/4 ln(3/2)
    back = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert float(kl_divergence(q, p)[0]) == pytest.approx(back, rel=1e-12)


def test_top10_agreement_of_permuted_logits() -> None:
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(4, 30, generator=g)
    top = torch.topk(ref, 10, dim=-1).indices
    # reordering the ten best among themselves keeps the set
    same = ref.clone()
    for i in range(4):
        same[i, top[i]] = ref[i, top[i].flip(0)]
    assert torch.equal(top_k_agreement(ref, same), torch.ones(4, dtype=torch.bool))
    # swapping the 10th best with the 11th best changes it, in row 2 only
    changed = ref.clone()
    order = ref[2].argsort(descending=True)
    a, b = order[9], order[10]
    changed[2, a], changed[2, b] = ref[2, b], ref[2, a]
    assert top_k_agreement(ref, changed).tolist() == [True, True, False, True]
    # a permutation of the whole vocabulary changes every set (for this seed)
    perm = torch.randperm(30, generator=g)
    assert not top_k_agreement(ref, ref[:, perm]).any()
    with pytest.raises(ValueError, match="k must be a positive int"):
        top_k_agreement(ref, ref, k=0)
    with pytest.raises(ValueError, match="shapes differ"):
        top_k_agreement(ref, ref[:, :20])


def test_perplexity_is_exp_of_mean_cross_entropy() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    ce = F.cross_entropy(logits.double().flatten(0, 1), targets.flatten())
    assert perplexity(logits, targets) == pytest.approx(math.exp(float(ce)), rel=1e-12)
    # a model certain of every target: perplexity 1; a uniform one: the vocabulary size
    sure = torch.full((1, 3, 4), -1e4)
    sure[0, torch.arange(3), torch.tensor([1, 2, 3])] = 0.0
    assert perplexity(sure, torch.tensor([[1, 2, 3]])) == 1.0
    assert perplexity(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]])) == pytest.approx(4.0)


def test_difference_absolute_relative_and_bit_identity() -> None:
    a = {"w": torch.tensor([1.0, -2.0, 4.0]), "b": torch.tensor([0.5])}
    d = difference(a, {k: v.clone() for k, v in a.items()})
    assert (d.max_abs, d.max_rel, d.identical, d.worst) == (0.0, 0.0, True, None)
    b = {"w": torch.tensor([1.0, -2.0, 4.0]), "b": torch.tensor([0.25])}
    d = difference(a, b)
    assert d.max_abs == 0.25 and d.worst == "b" and not d.identical
    assert d.max_rel == 1.0  # |0.5 - 0.25| / 0.25
    with pytest.raises(ValueError, match="tensor names differ"):
        difference(a, {"w": a["w"]})
    with pytest.raises(ValueError, match="shape"):
        difference({"w": torch.zeros(2)}, {"w": torch.zeros(3)})


def test_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="failure_step must be a positive int, got 0"):
        Sizes(full_every=2, failure_step=0, final_step=3, eval_batches=1)
    with pytest.raises(ValueError, match="final_step must be an int > failure_step"):
        Sizes(full_every=2, failure_step=3, final_step=3, eval_batches=1)
    with pytest.raises(ValueError, match="lr must be a positive float"):
        Sizes(full_every=2, failure_step=3, final_step=4, eval_batches=1, lr=0.0)


def test_a_workload_that_is_no_causal_lm_is_skipped_with_the_reason(tmp_path: Path) -> None:
    ctx = Context(BenchSettings("resnet-50-tiny", workdir=tmp_path), QUICK_PROFILE)
    rows = fidelity(ctx)
    assert len(rows) == 1 and "resnet-50-tiny" in rows[0]["skipped"]
    assert "Not run: workload 'resnet-50-tiny'" in section_fidelity(rows)
    assert plot_fidelity(tmp_path, rows) is None


def test_plan_and_groups(tmp_path: Path) -> None:
    ctx = Context(BenchSettings("gpt2-tiny", workdir=tmp_path), QUICK_PROFILE)
    sizes = Sizes(full_every=4, failure_step=6, final_step=9, eval_batches=1)
    cases = plan(ctx, sizes, tmp_path)
    got = {k: [c.arm.strategy for c in cs] for k, cs in cases.items()}
    assert got == {
        "gc-ef": ["lowdiff", "torch-save"],
        "gc": ["lowdiff", "torch-save"],
        "no-gc": ["lowdiff+", "torch-save", "checkfreq", "gemini", "naive-dc", "dcp-async"],
    }
    assert len({c.directory for cs in cases.values() for c in cs}) == 10
    # two DCP async Checkpointers never share a process (torch's process saver is global)
    s = Setting("x", "x", None)
    dcp = [Case(s, Arm(f"d{i}", "dcp-async"), str(tmp_path / str(i))) for i in range(2)]
    ts = Case(s, Arm("t", "torch-save"), str(tmp_path / "t"))
    assert [[c.arm.label for c in g] for g in _groups([dcp[0], ts, dcp[1]])] == [
        ["d0", "t"],
        ["d1"],
    ]


# --------------------------------------------------------------------------- a real run

EXACT = ("lowdiff", "lowdiff+", "torch-save")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("fidelity")
    ctx = Context(
        BenchSettings("gpt2-tiny", workdir=workdir),
        QUICK_PROFILE,
        methods=frozenset({*EXACT, "naive-dc"}),
    )
    rows = fidelity(ctx, Sizes(full_every=4, failure_step=6, final_step=9, eval_batches=2))
    assert not any(workdir.iterdir())  # checkpoint directories are removed
    return rows


def _rows(rows: list[dict[str, Any]], point: str, **match: Any) -> list[dict[str, Any]]:
    return [
        r
        for r in rows
        if r.get("point") == point
        and not r.get("reference")
        and all(r.get(k) == v for k, v in match.items())
    ]


@pytest.mark.multiprocess
def test_exact_strategies_recover_the_state_bit_for_bit(run: list[dict[str, Any]]) -> None:
    rec = _rows(run, "recovered")
    assert {(r["setting"], r["strategy"]) for r in rec} == {
        ("gc-ef", "lowdiff"),
        ("gc-ef", "torch-save"),
        ("gc", "lowdiff"),
        ("gc", "torch-save"),
        ("no-gc", "lowdiff+"),
        ("no-gc", "torch-save"),
        ("no-gc", "naive-dc"),
    }
    for r in rec:
        assert r["step"] == r["recovered_step"] == 6, r
        if r["strategy"] not in EXACT:
            continue
        assert r["model_bit_identical"] and r["optim_bit_identical"], r
        assert r["model_max_abs_diff"] == 0.0 and r["optim_max_abs_diff"] == 0.0, r
        assert r["kl"] == 0.0 and r["top10_agreement"] == 1.0, r
        assert r["ppl"] == r["reference_ppl"], r
    ld = _rows(run, "recovered", setting="gc-ef", strategy="lowdiff")[0]
    assert ld["recovery_source"] == "disk" and ld["records_replayed"] == 2  # full 4 + 4, 5
    plus = _rows(run, "recovered", strategy="lowdiff+")[0]
    assert plus["recovery_source"] == "memory"


@pytest.mark.multiprocess
def test_without_error_feedback_the_run_after_recovery_stays_exact(
    run: list[dict[str, Any]],
) -> None:
    final = _rows(run, "final", setting="gc") + _rows(run, "final", setting="no-gc")
    exact = [r for r in final if r["strategy"] in EXACT]
    assert len(exact) == 4
    for r in exact:
        assert r["step"] == 9 and r["model_bit_identical"] and r["optim_bit_identical"], r
        assert r["kl"] == 0.0 and r["top10_agreement"] == 1.0, r
    # with error feedback the residual restarts at zero for LowDiff and torch.save alike:
    # both recovered the same state, so both drift by exactly the same amount
    ld, ts = (
        _rows(run, "final", setting="gc-ef", strategy=s)[0] for s in ("lowdiff", "torch-save")
    )
    for key in ("model_max_abs_diff", "optim_max_abs_diff", "kl", "top10_agreement", "ppl"):
        assert ld[key] == ts[key], key


@pytest.mark.multiprocess
def test_naive_dc_error_is_measured(run: list[dict[str, Any]]) -> None:
    nd = _rows(run, "recovered", strategy="naive-dc")[0]
    assert nd["model_max_abs_diff"] > 0 and not nd["model_bit_identical"]
    assert nd["kl"] > 0
    trace = [r for r in run if r.get("point") == "trace" and r["strategy"] == "naive-dc"][0]
    assert trace["trace_steps"] == [6, 7, 8, 9]
    assert trace["trace_model_max_abs_diff"][0] == nd["model_max_abs_diff"]


@pytest.mark.multiprocess
def test_report_section_and_plot(run: list[dict[str, Any]], tmp_path: Path) -> None:
    md = section_fidelity(run)
    assert "| Method | PPL | ΔModel | ΔOptim. | KL | Top-10 |" in md
    assert "### At the recovered step" in md and "### At the final step" in md
    assert "| LowDiff+ | " in md and "not: Naive DC (no-gc)" in md
    png = plot_fidelity(tmp_path, run)
    assert png is not None and png.stat().st_size > 0
    assert section_fidelity([]) == ""
