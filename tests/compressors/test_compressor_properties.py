"""Property tests: the payload layout and the sparse round trip hold for any size and ratio."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff.compressors import QSGD, ApproxTopK, Compressor, RandomK, TopK

SETTINGS = settings(max_examples=50, deadline=None, database=None)

sizes = st.one_of(st.integers(1, 3000), st.integers(60000, 140000))
ratios = st.floats(min_value=1e-4, max_value=1.0, allow_nan=False)
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def _grad(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).to(dtype)


@st.composite
def sparsifiers(draw: st.DrawFn) -> TopK | ApproxTopK | RandomK:
    kind = draw(st.sampled_from(["topk", "approx", "randomk"]))
    ratio = draw(ratios)
    ef = draw(st.booleans())
    seed = draw(st.integers(0, 2**32))
    if kind == "topk":
        return TopK(ratio=ratio, error_feedback=ef)
    if kind == "approx":
        sample_ratio = draw(st.floats(min_value=1e-3, max_value=1.0))
        return ApproxTopK(ratio=ratio, error_feedback=ef, sample_ratio=sample_ratio, seed=seed)
    return RandomK(ratio=ratio, error_feedback=ef, seed=seed)


def _check_layout(
    c: Compressor, payload: dict[str, torch.Tensor], numel: int, dtype: torch.dtype
) -> None:
    fields = c.fields(numel, dtype)
    assert list(payload) == [f.name for f in fields]
    for f in fields:
        assert payload[f.name].dtype == f.dtype
        assert payload[f.name].shape == (f.numel,)


@SETTINGS
@given(c=sparsifiers(), numel=sizes, dtype=dtypes, seed=st.integers(0, 1000))
def test_sparse_round_trip_puts_accumulated_values_at_indices(
    c: TopK | ApproxTopK | RandomK, numel: int, dtype: torch.dtype, seed: int
) -> None:
    for step in range(2):
        grad = _grad(numel, dtype, seed + step)
        residual = c.residual(0)
        acc = grad if residual is None else grad + residual
        payload = c.compress(grad, key=0, step=step)
        _check_layout(c, payload, numel, dtype)

        idx = payload["indices"].long()
        assert idx.numel() == min(numel, max(1, math.ceil(c.ratio * numel)))
        assert idx.unique().numel() == idx.numel()
        assert torch.equal(payload["values"], acc[idx])

        out = c.decompress(payload, numel, dtype)
        assert torch.equal(out[idx], acc[idx])
        rest = torch.ones(numel, dtype=torch.bool)
        rest[idx] = False
        assert not out[rest].any()
        if c.error_feedback:
            new_residual = c.residual(0)
            assert new_residual is not None
            assert torch.equal(new_residual, torch.where(rest, acc, torch.zeros_like(acc)))


@SETTINGS
@given(
    numel=sizes,
    dtype=dtypes,
    bucket_size=st.integers(1, 4096),
    seed=st.integers(0, 2**32),
    scale=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e4]),
)
def test_qsgd_layout_and_bound(
    numel: int, dtype: torch.dtype, bucket_size: int, seed: int, scale: float
) -> None:
    c = QSGD(bucket_size=bucket_size, seed=seed)
    grad = (_grad(numel, torch.float32, seed % 1000) * scale).to(dtype)
    payload = c.compress(grad, key=1, step=seed)
    _check_layout(c, payload, numel, dtype)
    assert int(payload["codes"].abs().max()) <= 127
    out = c.decompress(payload, numel, torch.float32)
    bound = payload["scales"].repeat_interleave(bucket_size)[:numel] / 127
    assert bool(((out - grad.float()).abs() <= bound * (1 + 1e-5)).all())
