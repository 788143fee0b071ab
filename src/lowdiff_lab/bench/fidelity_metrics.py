"""The measures of ``lowdiff bench fidelity`` (Exp. 6): how far a recovered run is from
the uninterrupted one.

Perplexity, KL divergence and top-k agreement of next-token distributions
(:class:`OutputStats` sums them over held-out positions), and the largest absolute and
relative difference of two sets of named tensors (:func:`difference` over
:func:`model_tensors` or :func:`optimizer_tensors`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TOP_K = 10
"""Top-k agreement compares the sets of this many most likely next tokens."""

CHUNK_POSITIONS = 2048
"""Held-out positions whose next-token distributions are compared at once."""


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
class OutputStats:
    """Sums over the held-out positions of one model against the reference."""

    positions: int = 0
    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one batch: the reference's logits, this model's, and the next tokens."""
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
        """Perplexity over every position added so far."""
        return math.exp(self.nll / self.positions)


@torch.no_grad()
def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The causal LM's next-token logits for ``x`` in eval mode (no dropout), as float32;
    the model's training mode is restored after."""
    was = model.training
    model.eval()
    try:
        return model(input_ids=x, use_cache=False).logits.float()  # type: ignore[no-any-return]
    finally:
        model.train(was)
