"""Unit tests of the built-in compressors against the contract in ``compressors/base.py``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
import torch

from lowdiff.compressors import (
    QSGD,
    ApproxTopK,
    Compressor,
    FieldSpec,
    RandomK,
    TopK,
    compressor_from_spec,
    index_dtype_for,
)
from lowdiff.compressors.base import derive_seed
from lowdiff.compressors.merged import MergedSparse

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 65536, 65537, 100000]

FACTORIES: dict[str, Callable[[], Compressor]] = {
    "topk": lambda: TopK(ratio=0.01),
    "topk-noef": lambda: TopK(ratio=0.3, error_feedback=False),
    "approx": lambda: ApproxTopK(ratio=0.01),
    "approx-wide": lambda: ApproxTopK(ratio=0.05, sample_ratio=0.02, seed=3),
    "randomk": lambda: RandomK(ratio=0.01),
    "randomk-dense": lambda: RandomK(ratio=0.6, seed=2),
    "qsgd": lambda: QSGD(),
    "qsgd-odd": lambda: QSGD(bucket_size=7, seed=5),
}
SPARSIFIERS: dict[str, Callable[..., TopK | ApproxTopK | RandomK]] = {
    "topk": TopK,
    "approx": ApproxTopK,
    "randomk": RandomK,
}


def _randn(numel: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    # A private generator keeps the tests themselves off the global RNG.
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).to(dtype)


def _assert_layout(payload: dict[str, torch.Tensor], fields: list[FieldSpec]) -> None:
    assert list(payload) == [f.name for f in fields]
    for f in fields:
        t = payload[f.name]
        assert t.dtype == f.dtype, f.name
        assert t.dim() == 1 and t.numel() == f.numel, f.name
        assert t.is_contiguous(), f.name


# --- layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_payload_matches_fields(name: str, numel: int, dtype: torch.dtype) -> None:
    c = FACTORIES[name]()
    fields = c.fields(numel, dtype)
    for step in range(2):  # the second step runs with a residual where there is one
        grad = _randn(numel, dtype, seed=step)
        payload = c.compress(grad, key=3, step=step)
        _assert_layout(payload, fields)
        out = c.decompress(payload, numel, dtype)
        assert out.dtype == dtype and out.shape == (numel,)


@pytest.mark.parametrize(
    "values",
    [
        torch.zeros(100000),
        torch.full((100000,), 0.5),  # every magnitude tied
        torch.cat([torch.zeros(99000), torch.ones(1000) * 3]),
        torch.tensor([1.0, -1.0] * 40000),
    ],
    ids=["zeros", "constant", "few-large", "alternating"],
)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_payload_layout_for_degenerate_gradients(name: str, values: torch.Tensor) -> None:
    c = FACTORIES[name]()
    payload = c.compress(values, key=0, step=0)
    _assert_layout(payload, c.fields(values.numel(), values.dtype))
    if "indices" in payload:
        assert payload["indices"].long().unique().numel() == payload["indices"].numel()


def test_index_dtype_and_record_size() -> None:
    c = TopK(ratio=0.01)
    assert c.fields(65536, torch.float32)[1] == FieldSpec("indices", torch.uint16, 656)
    assert c.fields(65537, torch.float32)[1].dtype == torch.int32
    assert index_dtype_for(65537) == torch.int32
    # fp32 value + uint16 index = 6 bytes per kept entry, i.e. about 6 * ratio per parameter.
    numel = 50000
    nbytes = sum(f.numel * f.dtype.itemsize for f in c.fields(numel, torch.float32))
    assert nbytes <= 8 * 0.01 * numel


@pytest.mark.parametrize("name", ["topk", "approx", "randomk"])
def test_k_is_ceil_ratio_capped(name: str) -> None:
    c = SPARSIFIERS[name](ratio=0.3)
    assert [c.k_for(n) for n in (0, 1, 2, 3, 10, 11)] == [0, 1, 1, 1, 3, 4]
    full = SPARSIFIERS[name](ratio=1.0)
    assert full.k_for(17) == 17


def test_qsgd_fields() -> None:
    assert QSGD(bucket_size=512).fields(1025, torch.bfloat16) == [
        FieldSpec("codes", torch.int8, 1025),
        FieldSpec("scales", torch.float32, 3),
    ]


# --- decompress ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_decompress_is_pure_and_deterministic(name: str, dtype: torch.dtype) -> None:
    numel = 70001
    c = FACTORIES[name]()
    payload = c.compress(_randn(numel, dtype), key=1, step=4)
    before = {n: t.clone() for n, t in payload.items()}
    a = c.decompress(payload, numel, dtype)
    b = compressor_from_spec(c.spec()).decompress(payload, numel, dtype)
    assert torch.equal(a, b)
    assert a.data_ptr() != b.data_ptr()
    assert all(a.data_ptr() != t.data_ptr() for t in payload.values())
    for n, t in payload.items():
        assert torch.equal(t, before[n]), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_decompress_into_equals_decompress_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    numel = 70001
    c = FACTORIES[name]()
    grad = _randn(numel, dtype, seed=3)
    payload = c.compress(grad, key=2, step=5)
    want = c.decompress(payload, numel, dtype)
    # into the gradient itself, as training does (the payload may be that very tensor)
    c.decompress_into(payload, grad)
    assert torch.equal(grad, want)
    junk = torch.full((numel,), 7.0, dtype=dtype)  # whatever was there before is replaced
    c.decompress_into(payload, junk)
    assert torch.equal(junk, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", [*FACTORIES, "merged"])
def test_decompress_many_equals_decompress_of_each_bit_for_bit(
    name: str, dtype: torch.dtype
) -> None:
    # sizes across both index dtypes (uint16 up to 65,536 elements, int32 beyond), a
    # one-element gradient, and payloads that are views into one row, as in a record
    numels = [1, 70001, 300, 65536, 65537, 9]
    c = MergedSparse(TopK(0.01), world_size=2) if name == "merged" else FACTORIES[name]()
    grads = [_randn(n, dtype, seed=i) for i, n in enumerate(numels)]
    if name == "merged":  # what it carries: the sum of the ranks' sparse gradients
        top = TopK(0.01, error_feedback=False)
        grads = [top.decompress(top.compress(g, key=0, step=0), g.numel(), dtype) for g in grads]
    payloads = [c.compress(g, key=i, step=4) for i, g in enumerate(grads)]
    if "indices" in payloads[0]:  # the record's narrow and wide index dtypes both occur
        assert {p["indices"].dtype for p in payloads} >= {torch.uint16, torch.int32}
    row = torch.zeros(
        sum(t.numel() * 8 + 8 for p in payloads for t in p.values()), dtype=torch.uint8
    )
    views, off = [], 0
    for p in payloads:
        v = {}
        for k, t in p.items():
            nbytes = t.numel() * t.element_size()
            v[k] = row[off : off + nbytes].view(t.dtype)
            v[k].copy_(t.reshape(-1))
            off += -(-nbytes // 8) * 8  # aligned, as a record layout keeps them
        views.append(v)
    got = c.decompress_many(views, numels, dtype)
    want = torch.cat([c.decompress(p, n, dtype) for p, n in zip(payloads, numels, strict=True)])
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert c.decompress_many([], [], dtype).numel() == 0


def test_decompress_many_refuses_a_payload_that_does_not_fit() -> None:
    c = TopK(0.01)
    good = c.compress(_randn(1000), key=0, step=0)
    with pytest.raises(ValueError, match="TopK"):
        c.decompress_many([good, good], [1000, 5000], torch.float32)


@pytest.mark.parametrize("name", ["topk", "approx", "randomk"])
def test_sparse_decompress_puts_values_at_indices(name: str) -> None:
    numel = 100000
    grad = _randn(numel)
    c = SPARSIFIERS[name](ratio=0.02, error_feedback=False)
    payload = c.compress(grad, key=0, step=0)
    idx = payload["indices"].long()
    assert torch.equal(payload["values"], grad[idx])
    out = c.decompress(payload, numel, torch.float32)
    expected = torch.zeros(numel)
    expected[idx] = grad[idx]
    assert torch.equal(out, expected)


def test_decompress_rejects_mismatched_payload() -> None:
    c = TopK(ratio=0.1)
    payload = c.compress(_randn(100), key=0, step=0)
    with pytest.raises(ValueError, match="indices"):
        c.decompress({**payload, "indices": payload["indices"].int()}, 100, torch.float32)
    with pytest.raises(ValueError, match="values"):
        c.decompress({"indices": payload["indices"]}, 100, torch.float32)
    with pytest.raises(ValueError, match="values"):
        c.decompress(payload, 100, torch.float16)
    q = QSGD()
    qp = q.compress(_randn(100), key=0, step=0)
    with pytest.raises(ValueError, match="scales"):
        q.decompress({**qp, "scales": qp["scales"][:0]}, 100, torch.float32)


# --- selection -----------------------------------------------------------------------------


def _distinct_magnitudes(numel: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = (torch.randperm(numel, generator=gen) + 1).float()
    signs = torch.randint(0, 2, (numel,), generator=gen).float() * 2 - 1
    return magnitudes * signs


@pytest.mark.parametrize("numel", [10, 1000, 70000])
def test_topk_selects_exactly_the_largest_magnitudes(numel: int) -> None:
    grad = _distinct_magnitudes(numel)
    c = TopK(ratio=0.05, error_feedback=False)
    k = c.k_for(numel)
    payload = c.compress(grad, key=0, step=0)
    reference = torch.argsort(grad.abs(), descending=True)[:k]
    assert set(payload["indices"].long().tolist()) == set(reference.tolist())


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("numel", [65536, 200000])
def test_approx_topk_returns_k_unique_and_captures_topk_mass(numel: int, ratio: float) -> None:
    grad = _randn(numel, seed=11)
    c = ApproxTopK(ratio=ratio, error_feedback=False)
    k = c.k_for(numel)
    for step in range(3):
        idx = c.compress(grad, key=0, step=step)["indices"].long()
        assert idx.numel() == k and idx.unique().numel() == k
        exact_mass = torch.topk(grad.abs(), k).values.sum()
        assert grad[idx].abs().sum() >= 0.9 * exact_mass


@pytest.mark.parametrize("nan_fraction", [0.02, 0.3, 1.0])
def test_approx_topk_threshold_fallbacks_still_give_k(nan_fraction: float) -> None:
    # NaNs poison sampled thresholds, which drives the lowering rounds and the exact fallback.
    numel = 100000
    grad = _randn(numel, seed=5)
    gen = torch.Generator().manual_seed(6)
    grad[torch.rand(numel, generator=gen) < nan_fraction] = float("nan")
    c = ApproxTopK(ratio=0.01, error_feedback=False)
    payload = c.compress(grad, key=0, step=0)
    idx = payload["indices"].long()
    assert idx.numel() == c.k_for(numel) and idx.unique().numel() == idx.numel()
    torch.testing.assert_close(payload["values"], grad[idx], rtol=0, atol=0, equal_nan=True)


def test_randomk_indices_unique_and_seeded() -> None:
    numel = 100000
    grad = _randn(numel)
    c = RandomK(ratio=0.01, error_feedback=False, seed=7)

    def indices(comp: RandomK, key: int, step: int) -> torch.Tensor:
        return comp.compress(grad, key=key, step=step)["indices"].long()

    first = indices(c, 2, 5)
    assert first.unique().numel() == first.numel() == c.k_for(numel)
    assert torch.equal(first, indices(c, 2, 5))
    assert torch.equal(first, indices(RandomK(ratio=0.01, error_feedback=False, seed=7), 2, 5))
    assert not torch.equal(first, indices(c, 2, 6))
    assert not torch.equal(first, indices(c, 3, 5))
    assert not torch.equal(first, indices(RandomK(ratio=0.01, error_feedback=False, seed=8), 2, 5))


def test_randomk_dense_path_unique() -> None:
    c = RandomK(ratio=0.7, error_feedback=False)
    idx = c.compress(_randn(1001), key=0, step=0)["indices"].long()
    assert idx.numel() == c.k_for(1001) and idx.unique().numel() == idx.numel()


def test_randomk_is_roughly_uniform() -> None:
    numel, steps = 100, 2000
    c = RandomK(ratio=0.1, error_feedback=False)
    grad = torch.zeros(numel)
    counts = torch.zeros(numel)
    for step in range(steps):
        counts[c.compress(grad, key=0, step=step)["indices"].long()] += 1
    # Each index is kept with probability 0.1: mean 200, sd about 13.
    assert counts.min() > 140 and counts.max() < 260


# --- error feedback ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["topk", "approx", "randomk"])
@pytest.mark.parametrize("numel", [1000, 70000])
def test_error_feedback_conserves_gradient_mass(name: str, numel: int) -> None:
    # Small integers keep every fp32 sum exact, so conservation can be checked bit for bit.
    c = SPARSIFIERS[name](ratio=0.05)
    gen = torch.Generator().manual_seed(3)
    raw_sum = torch.zeros(numel)
    applied_sum = torch.zeros(numel)
    for step in range(6):
        grad = torch.randint(-50, 51, (numel,), generator=gen).float()
        raw_sum += grad
        applied_sum += c.decompress(c.compress(grad, key=9, step=step), numel, torch.float32)
    residual = c.residual(9)
    assert residual is not None
    assert torch.equal(applied_sum + residual, raw_sum)


@pytest.mark.parametrize("name", ["topk", "approx", "randomk"])
def test_error_feedback_selects_from_accumulated_gradient(name: str) -> None:
    numel = 2000
    c = SPARSIFIERS[name](ratio=0.01)
    c.compress(_randn(numel, seed=1), key=0, step=0)
    residual = c.residual(0)
    assert residual is not None
    grad = _randn(numel, seed=2)
    payload = c.compress(grad, key=0, step=1)
    idx = payload["indices"].long()
    assert torch.equal(payload["values"], (grad + residual)[idx])
    if name == "topk":
        reference = torch.topk((grad + residual).abs(), c.k_for(numel)).indices
        assert set(idx.tolist()) == set(reference.tolist())


@pytest.mark.parametrize("name", ["topk", "approx", "randomk"])
def test_reset_state_and_no_error_feedback(name: str) -> None:
    grad = _randn(500)
    c = SPARSIFIERS[name](ratio=0.1)
    first = c.compress(grad, key=0, step=0)
    assert c.residual(0) is not None
    c.reset_state()
    assert c.residual(0) is None
    again = c.compress(grad, key=0, step=0)
    assert all(torch.equal(first[n], again[n]) for n in first)

    plain = SPARSIFIERS[name](ratio=0.1, error_feedback=False)
    a = plain.compress(grad, key=0, step=0)
    assert plain.residual(0) is None
    b = plain.compress(grad, key=0, step=0)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_residual_shape_mismatch_raises() -> None:
    c = TopK(ratio=0.1)
    c.compress(_randn(100), key=4, step=0)
    with pytest.raises(ValueError, match="key 4"):
        c.compress(_randn(101), key=4, step=1)
    with pytest.raises(ValueError, match="key 4"):
        c.compress(_randn(100, torch.float16), key=4, step=1)


def test_ratio_one_sends_everything() -> None:
    grad = _randn(300)
    c = TopK(ratio=1.0)
    payload = c.compress(grad, key=0, step=0)
    assert torch.equal(c.decompress(payload, 300, torch.float32), grad)
    residual = c.residual(0)
    assert residual is not None and torch.equal(residual, torch.zeros(300))


# --- QSGD ----------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 511, 512, 5000])
@pytest.mark.parametrize("bucket_size", [1, 64, 512])
def test_qsgd_error_within_one_level(numel: int, bucket_size: int) -> None:
    grad = _randn(numel, seed=numel) * 3
    c = QSGD(bucket_size=bucket_size)
    payload = c.compress(grad, key=0, step=0)
    out = c.decompress(payload, numel, torch.float32)
    n_buckets = math.ceil(numel / bucket_size)
    padded = torch.zeros(n_buckets * bucket_size)
    padded[:numel] = grad
    scales = padded.view(n_buckets, bucket_size).abs().amax(dim=1)
    assert torch.equal(payload["scales"], scales)
    bound = scales.repeat_interleave(bucket_size)[:numel] / 127
    assert bool(((out - grad).abs() <= bound * (1 + 1e-5)).all())
    assert int(payload["codes"].abs().max()) <= 127


def test_qsgd_zero_buckets_give_zeros() -> None:
    grad = torch.cat([torch.zeros(512), _randn(512), torch.zeros(100)])
    c = QSGD(bucket_size=512)
    payload = c.compress(grad, key=0, step=0)
    assert payload["scales"][0] == 0 and payload["scales"][2] == 0
    out = c.decompress(payload, grad.numel(), torch.float32)
    assert not out.isnan().any()
    assert torch.equal(out[:512], torch.zeros(512)) and torch.equal(out[1024:], torch.zeros(100))


def test_qsgd_seeded_and_unbiased() -> None:
    grad = _randn(1000)
    c = QSGD(bucket_size=100, seed=1)
    a = c.compress(grad, key=2, step=3)
    assert torch.equal(a["codes"], QSGD(bucket_size=100, seed=1).compress(grad, 2, 3)["codes"])
    assert not torch.equal(a["codes"], c.compress(grad, key=2, step=4)["codes"])
    assert not torch.equal(a["codes"], c.compress(grad, key=1, step=3)["codes"])
    mean = torch.stack(
        [c.decompress(c.compress(grad, key=0, step=s), 1000, torch.float32) for s in range(200)]
    ).mean(dim=0)
    # One draw errs by up to scale/127 (scale ~3); the mean of 200 shrinks that ~14-fold.
    assert float((mean - grad).abs().max()) < 3 / 127 / 3


def test_qsgd_decompress_to_low_precision() -> None:
    grad = _randn(3000, torch.bfloat16)
    c = QSGD()
    out = c.decompress(c.compress(grad, key=0, step=0), 3000, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - grad.float()).abs().max()) < 0.05


def test_qsgd_has_no_error_feedback() -> None:
    c = QSGD()
    assert c.error_feedback is False
    c.reset_state()


# --- side effects --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_compress_leaves_global_rng_and_input_alone(name: str, dtype: torch.dtype) -> None:
    c = FACTORIES[name]()
    grad = _randn(70000, dtype)
    original = grad.clone()
    rng = torch.get_rng_state()
    for step in range(2):
        payload = c.compress(grad, key=0, step=step)
        c.decompress(payload, grad.numel(), dtype)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(grad, original)


def test_compress_rejects_bad_gradients() -> None:
    c = TopK()
    with pytest.raises(ValueError, match="1-D"):
        c.compress(torch.zeros(4, 4), key=0, step=0)
    with pytest.raises(ValueError, match="contiguous"):
        c.compress(torch.zeros(8)[::2], key=0, step=0)
    with pytest.raises(TypeError, match="floating"):
        QSGD().compress(torch.zeros(8, dtype=torch.int32), key=0, step=0)


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FACTORIES))
def test_spec_round_trip(name: str) -> None:
    c = FACTORIES[name]()
    spec = json.loads(json.dumps(c.spec()))
    rebuilt = compressor_from_spec(spec)
    assert type(rebuilt) is type(c)
    assert rebuilt.spec() == c.spec()
    assert spec["kind"] == type(c).kind
    assert repr(rebuilt) == repr(c)


def test_spec_contents() -> None:
    assert ApproxTopK(0.02, False, 0.05, 9).spec() == {
        "kind": "approx-topk",
        "ratio": 0.02,
        "error_feedback": False,
        "sample_ratio": 0.05,
        "seed": 9,
    }
    assert RandomK().spec() == {"kind": "randomk", "ratio": 0.01, "error_feedback": True, "seed": 0}
    assert QSGD().spec() == {"kind": "qsgd", "bits": 8, "bucket_size": 512, "seed": 0}
    assert TopK().spec() == {"kind": "topk", "ratio": 0.01, "error_feedback": True}


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="nope"):
        compressor_from_spec({"kind": "nope"})


@pytest.mark.parametrize(
    ("factory", "kwargs", "pattern"),
    [
        (TopK, {"ratio": 1.5}, r"ratio must be in \(0, 1\], got 1.5"),
        (TopK, {"ratio": 0}, r"ratio .* got 0"),
        (TopK, {"ratio": -0.1}, r"ratio .* got -0.1"),
        (TopK, {"ratio": float("nan")}, r"ratio .* got nan"),
        (ApproxTopK, {"sample_ratio": 0.0}, r"sample_ratio .* got 0.0"),
        (ApproxTopK, {"ratio": 2}, r"ratio .* got 2"),
        (ApproxTopK, {"seed": -1}, r"seed .* got -1"),
        (RandomK, {"seed": -3}, r"seed .* got -3"),
        (RandomK, {"ratio": 1.01}, r"ratio .* got 1.01"),
        (QSGD, {"bits": 4}, r"bits must be 8.* got 4"),
        (QSGD, {"bucket_size": 0}, r"bucket_size .* got 0"),
        (QSGD, {"seed": -1}, r"seed .* got -1"),
    ],
)
def test_invalid_arguments_raise_value_error(
    factory: Callable[..., Compressor], kwargs: dict[str, object], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        factory(**kwargs)
    assert factory.__name__ in str(info.value)


@pytest.mark.parametrize(
    ("factory", "kwargs", "name"),
    [
        (TopK, {"ratio": "0.1"}, "ratio"),
        (TopK, {"error_feedback": 1}, "error_feedback"),
        (ApproxTopK, {"seed": 1.5}, "seed"),
        (RandomK, {"ratio": True}, "ratio"),
        (QSGD, {"bits": True}, "bits"),
        (QSGD, {"bucket_size": 512.0}, "bucket_size"),
    ],
)
def test_wrong_argument_types_raise_type_error(
    factory: Callable[..., Compressor], kwargs: dict[str, object], name: str
) -> None:
    with pytest.raises(TypeError, match=name):
        factory(**kwargs)


def test_fields_rejects_bad_layout_arguments() -> None:
    with pytest.raises(ValueError, match="numel"):
        TopK().fields(-1, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        TopK().fields(10, torch.int32)
    with pytest.raises(ValueError, match="numel"):
        QSGD().fields(-1, torch.float32)


def test_derive_seed_is_stable_and_spread() -> None:
    # Recovery in another process, or another lowdiff version, must see the same seeds.
    assert derive_seed(0, 0, 0) == 7177887840772116161
    assert derive_seed(1, 2, 3, 4) == 6990634552898421246
    seeds = {derive_seed(1, step, key) for step in range(50) for key in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 1 << 63 for s in seeds)
