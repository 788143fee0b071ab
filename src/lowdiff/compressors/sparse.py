"""Sparsifying compressors: keep ``k`` entries of each gradient, as (values, indices).

All three share one payload layout, ``"values"`` (the gradient's dtype) and ``"indices"``
(:func:`~lowdiff.compressors.base.index_dtype_for`), both of exactly
``k = min(numel, max(1, ceil(ratio * numel)))`` elements, and one decompressor: zeros with
the values put at the (unique) indices. They differ only in how the indices are chosen.

With error feedback (the default) each compressor keeps a dense residual per parameter key:
the gradient mass that was not sent is added back before the next selection, so nothing is
lost, only delayed. The residual is updated in place and doubles as the accumulator, so a
step allocates nothing dense beyond what the selection itself needs.
"""

from __future__ import annotations

import itertools
import math
import numbers
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from lowdiff.compressors.base import (
    Compressor,
    FieldSpec,
    check_flat_grad,
    check_payload,
    index_dtype_for,
    register,
    seeded_generator,
)
from lowdiff.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["ApproxTopK", "RandomK", "TopK"]


def _check_fraction(who: str, name: str, value: Any) -> float:
    """Validate a number in (0, 1] and return it as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{who}: {name} must be a real number, got {value!r}")
    result = float(value)
    # Written so that NaN fails too.
    if not 0.0 < result <= 1.0:
        raise InvalidArgumentError(f"{who}: {name} must be in (0, 1], got {value!r}")
    return result


def _check_bool(who: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{who}: {name} must be a bool, got {value!r}")
    return value


def _check_seed(who: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{who}: seed must be an int, got {value!r}")
    result = int(value)
    if result < 0:
        raise InvalidArgumentError(f"{who}: seed must be >= 0, got {value!r}")
    return result


def _check_layout_args(who: str, numel: int, dtype: torch.dtype) -> None:
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral):
        raise ArgumentTypeError(f"{who}: numel must be an int, got {numel!r}")
    if numel < 0:
        raise InvalidArgumentError(f"{who}: numel must be >= 0, got {numel!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ArgumentTypeError(f"{who}: dtype must be a floating-point torch.dtype, got {dtype!r}")


class _Sparsifier(Compressor):
    """Shared machinery of the sparsifiers: layout, error feedback, decompression.

    Subclasses implement :meth:`_select`, which returns ``k`` unique int64 indices into the
    accumulated gradient.
    """

    _SALT: ClassVar[int] = 0
    """Mixed into the generator seed so that different kinds draw different streams."""

    def __init__(self, ratio: float, error_feedback: bool) -> None:
        who = type(self).__name__
        self.ratio: float = _check_fraction(who, "ratio", ratio)
        self.error_feedback = _check_bool(who, "error_feedback", error_feedback)
        self._residuals: dict[int, torch.Tensor] = {}

    def k_for(self, numel: int) -> int:
        """Number of entries kept for a gradient of ``numel`` elements."""
        if numel <= 0:
            return 0
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def fields(self, numel: int, dtype: torch.dtype) -> list[FieldSpec]:
        _check_layout_args(type(self).__name__, numel, dtype)
        k = self.k_for(numel)
        return [
            FieldSpec("values", dtype, k),
            FieldSpec("indices", index_dtype_for(numel), k),
        ]

    def compress(self, grad: torch.Tensor, key: int, step: int) -> dict[str, torch.Tensor]:
        check_flat_grad(type(self).__name__, grad)
        numel = grad.numel()
        k = self.k_for(numel)

        if self.error_feedback:
            residual = self._residuals.get(key)
            if residual is None:
                acc = grad.clone()
            else:
                if (
                    residual.numel() != numel
                    or residual.dtype != grad.dtype
                    or residual.device != grad.device
                ):
                    raise InvalidArgumentError(
                        f"{type(self).__name__}: residual for key {key} holds "
                        f"{residual.numel()} {residual.dtype} elements on {residual.device}, "
                        f"but the gradient has {numel} {grad.dtype} elements on {grad.device}"
                    )
                # The residual buffer becomes the accumulator: no dense allocation per step.
                # IEEE addition is commutative, so this equals grad + residual bit for bit.
                acc = residual.add_(grad)
        else:
            # Read-only from here on: the caller's gradient is never modified.
            acc = grad

        if k == numel:
            indices = torch.arange(numel, device=grad.device)
        else:
            indices = self._select(acc, k, key, step)

        values = acc.index_select(0, indices)
        if self.error_feedback:
            # acc minus exactly what was sent, i.e. acc - decompress(payload), without a subtraction.
            acc.index_fill_(0, indices, 0)
            self._residuals[key] = acc
        return {"values": values, "indices": indices.to(index_dtype_for(numel))}

    def decompress(
        self, payload: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        check_payload(type(self).__name__, payload, self.fields(numel, dtype))
        values = payload["values"]
        # uint16 cannot index; the copy is only k elements. Unique indices make the
        # scatter order irrelevant, so the result is deterministic on every device.
        indices = payload["indices"].long()
        out = torch.zeros(numel, dtype=dtype, device=values.device)
        out.index_put_((indices,), values)
        return out

    def decompress_into(self, payload: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        check_payload(type(self).__name__, payload, self.fields(out.numel(), out.dtype))
        out.zero_()
        out.index_put_((payload["indices"].long(),), payload["values"])

    def decompress_many(
        self,
        payloads: Sequence[Mapping[str, torch.Tensor]],
        numels: Sequence[int],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """All the gradients in one scatter: every payload's indices moved by its
        gradient's offset, one ``index_put_`` into one zeroed tensor (the indices are
        unique, so the result is what a scatter per gradient gives)."""
        if not payloads:
            return torch.zeros(0, dtype=dtype)
        for payload, n in zip(payloads, numels, strict=True):
            k, v, i = self.k_for(n), payload.get("values"), payload.get("indices")
            if (
                v is None
                or i is None
                or v.dtype != dtype
                or i.dtype != index_dtype_for(n)
                or v.shape != (k,)
                or i.shape != (k,)
            ):
                # the full check names what is wrong
                check_payload(type(self).__name__, payload, self.fields(n, dtype))
        values = torch.cat([p["values"] for p in payloads])
        indices = torch.cat([p["indices"].long() for p in payloads])
        offsets = torch.tensor(list(itertools.accumulate(numels[:-1], initial=0)))
        ks = torch.tensor([p["indices"].numel() for p in payloads])
        indices += torch.repeat_interleave(offsets, ks).to(indices.device)
        out = torch.zeros(sum(numels), dtype=dtype, device=values.device)
        out.index_put_((indices,), values)
        return out

    def reset_state(self) -> None:
        self._residuals.clear()

    def residual(self, key: int) -> torch.Tensor | None:
        """A copy of the error-feedback residual for ``key``, or ``None`` if there is none."""
        residual = self._residuals.get(key)
        return None if residual is None else residual.clone()

    @abstractmethod
    def _select(self, acc: torch.Tensor, k: int, key: int, step: int) -> torch.Tensor:
        """``k`` unique int64 indices into ``acc`` (``0 < k < acc.numel()``); reads only."""


def _exact_topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(magnitudes, k, sorted=False).indices


@register
class TopK(_Sparsifier):
    """Exact top-k sparsification by magnitude.

    Args:
        ratio: Fraction of entries kept, in (0, 1]; ``k = max(1, ceil(ratio * numel))``.
        error_feedback: Carry the unsent mass over to the next step (per parameter key).

    Example:
        >>> import torch
        >>> c = TopK(ratio=0.5, error_feedback=False)
        >>> p = c.compress(torch.tensor([0.1, -3.0, 2.0, 0.5]), key=0, step=0)
        >>> c.decompress(p, 4, torch.float32)
        tensor([ 0., -3.,  2.,  0.])
    """

    kind = "topk"

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(ratio, error_feedback)

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "ratio": self.ratio, "error_feedback": self.error_feedback}

    def _select(self, acc: torch.Tensor, k: int, key: int, step: int) -> torch.Tensor:
        return _exact_topk(acc.abs(), k)


@register
class ApproxTopK(_Sparsifier):
    """Top-k by a sampled magnitude threshold (DGC style); always exactly ``k`` entries.

    The threshold is estimated from a seeded random sample of ``|acc|`` a little below the
    ``k``-th largest magnitude, so one linear pass usually yields slightly more than ``k``
    candidates; the exact top-k of those few is kept. If too few pass, the threshold is
    lowered along the sample a few times, and finally exact top-k is used. Small tensors
    (where sampling does not pay) use exact top-k directly.

    Args:
        ratio: Fraction of entries kept, in (0, 1]; ``k = max(1, ceil(ratio * numel))``.
        error_feedback: Carry the unsent mass over to the next step (per parameter key).
        sample_ratio: Fraction of entries sampled for the threshold (at least 4096 are).
        seed: Seeds the private sampling generator together with ``(step, key)``.

    Example:
        >>> import torch
        >>> c = ApproxTopK(ratio=0.01)
        >>> p = c.compress(torch.randn(1 << 20), key=0, step=0)
        >>> p["values"].numel(), p["indices"].dtype
        (10486, torch.int32)
    """

    kind = "approx-topk"
    _SALT = 0xA770_7091

    _MIN_APPROX_NUMEL: ClassVar[int] = 1 << 16
    """Below this, exact top-k is about as fast as the sampled path."""
    _MIN_SAMPLE: ClassVar[int] = 4096
    """A quantile estimate from fewer draws is too noisy to be worth the extra pass."""
    _LOWERINGS: ClassVar[int] = 3
    """Times the threshold is lowered (each doubling the sample rank) before exact top-k."""

    def __init__(
        self,
        ratio: float = 0.01,
        error_feedback: bool = True,
        sample_ratio: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__(ratio, error_feedback)
        self.sample_ratio: float = _check_fraction("ApproxTopK", "sample_ratio", sample_ratio)
        self.seed: int = _check_seed("ApproxTopK", seed)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ratio": self.ratio,
            "error_feedback": self.error_feedback,
            "sample_ratio": self.sample_ratio,
            "seed": self.seed,
        }

    def _select(self, acc: torch.Tensor, k: int, key: int, step: int) -> torch.Tensor:
        numel = acc.numel()
        if numel < self._MIN_APPROX_NUMEL:
            return _exact_topk(acc.abs(), k)

        n_sample = max(math.ceil(self.sample_ratio * numel), self._MIN_SAMPLE)
        # Expected sample rank of the k-th largest, pushed down by three standard deviations
        # of the order statistic so that the first pass falls short of k only rarely.
        expected = k * n_sample / numel
        rank = math.ceil(expected + 3.0 * math.sqrt(expected)) + 1
        if rank >= n_sample // 2:
            # The threshold would pass a large share of entries: no saving over exact top-k.
            return _exact_topk(acc.abs(), k)
        max_rank = min(n_sample, rank << self._LOWERINGS)

        gen = seeded_generator(self.seed, step, key, self._SALT, acc.device)
        sample_at = torch.randint(0, numel, (n_sample,), generator=gen, device=acc.device)
        ladder = torch.topk(acc.index_select(0, sample_at).abs_(), max_rank, sorted=True).values

        magnitudes = acc.abs()
        # The mask is padded with False to whole 8-byte words so that _sparse_nonzero can scan
        # it as int64; only the last word has padding, and `ge` overwrites everything else.
        mask_words = torch.empty((numel + 7) // 8, dtype=torch.int64, device=acc.device)
        mask_words[-1] = 0
        mask = mask_words.view(torch.bool)[:numel]
        while True:
            torch.ge(magnitudes, ladder[rank - 1], out=mask)
            # Expected pass rate is about rank / n_sample; the word scan only pays when most
            # 8-entry words hold no candidate at all.
            if rank * 32 <= n_sample:
                candidates = _sparse_nonzero(mask_words)
            else:
                candidates = torch.nonzero(mask).squeeze(1)
            if candidates.numel() >= k:
                break
            if rank >= max_rank:
                return _exact_topk(magnitudes, k)
            rank = min(rank * 2, max_rank)

        if candidates.numel() == k:
            return candidates
        top = _exact_topk(magnitudes.index_select(0, candidates), k)
        return candidates.index_select(0, top)


def _sparse_nonzero(words: torch.Tensor) -> torch.Tensor:
    """Ascending int64 positions of the ``True`` entries of a mostly-``False`` bool mask.

    ``words`` is the mask's memory viewed as int64 (the mask padded with ``False`` to whole
    words). On CPU ``torch.nonzero`` costs a few ns per scanned entry however sparse the
    mask is; scanning 8 entries per word first, then only the bytes of the words that hold
    a candidate, is several times faster at ~1% density. Only byte order in memory is
    used, never the integer value, so the result does not depend on endianness.
    """
    hit_words = torch.nonzero(words).squeeze(1)
    hit_bytes = torch.nonzero(words.index_select(0, hit_words).view(torch.uint8)).squeeze(1)
    word_of_byte = hit_words.index_select(0, hit_bytes.div(8, rounding_mode="floor"))
    return word_of_byte.mul_(8).add_(hit_bytes.remainder_(8))


@register
class RandomK(_Sparsifier):
    """Uniformly random ``k`` entries per step, unscaled.

    The indices are a uniform random ``k``-subset drawn from a private generator seeded by
    ``(seed, step, key)``, so they are reproducible but differ from step to step.

    Args:
        ratio: Fraction of entries kept, in (0, 1]; ``k = max(1, ceil(ratio * numel))``.
        error_feedback: Carry the unsent mass over to the next step (per parameter key).
        seed: Seeds the private index generator together with ``(step, key)``.

    Example:
        >>> import torch
        >>> c = RandomK(ratio=0.25, error_feedback=False, seed=1)
        >>> p = c.compress(torch.arange(8.0), key=0, step=3)
        >>> torch.equal(p["values"], p["indices"].long().float())
        True
    """

    kind = "randomk"
    _SALT = 0x5A4D_0E11

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True, seed: int = 0) -> None:
        super().__init__(ratio, error_feedback)
        self.seed: int = _check_seed("RandomK", seed)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ratio": self.ratio,
            "error_feedback": self.error_feedback,
            "seed": self.seed,
        }

    def _select(self, acc: torch.Tensor, k: int, key: int, step: int) -> torch.Tensor:
        numel = acc.numel()
        device = acc.device
        gen = seeded_generator(self.seed, step, key, self._SALT, device)
        if 2 * k > numel:
            # Dense selection: a permutation is as cheap as anything else here.
            return torch.randperm(numel, generator=gen, device=device)[:k]

        # Sparse selection without an O(numel) permutation: draw with replacement and keep
        # the first k distinct draws in draw order. That is sequential sampling with
        # rejection of repeats, so the result is a uniform k-subset. The margin covers the
        # expected number of repeats (about m^2 / 2n) generously; a shortfall draws more.
        margin = math.ceil(2 * k * k / numel) + 32
        draws = torch.randint(0, numel, (k + margin,), generator=gen, device=device)
        while True:
            chosen = _first_distinct(draws, k)
            if chosen is not None:
                return chosen
            more = torch.randint(0, numel, (margin,), generator=gen, device=device)
            draws = torch.cat((draws, more))


def _first_distinct(draws: torch.Tensor, k: int) -> torch.Tensor | None:
    """The first ``k`` distinct values of ``draws`` in draw order, or ``None`` if fewer exist."""
    ordered, order = torch.sort(draws, stable=True)
    # Stable sort: the first element of each run of equal values is its earliest draw.
    run_start = torch.ones_like(ordered, dtype=torch.bool)
    torch.ne(ordered[1:], ordered[:-1], out=run_start[1:])
    first_positions = order[run_start]
    if first_positions.numel() < k:
        return None
    is_first = torch.zeros_like(draws, dtype=torch.bool)
    is_first[first_positions] = True
    return draws.index_select(0, torch.nonzero(is_first).squeeze(1)[:k])
