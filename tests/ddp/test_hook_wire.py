"""What lowdiff's DDP hook puts on the wire: narrow index dtypes, values in the training
dtype, and the byte counter the bench reads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff
from lowdiff.ddp.hooks import IndexLayout, WireStats, wire_index_dtype


@pytest.mark.parametrize(
    ("numel", "dtype"),
    [
        (1, torch.uint8),
        (256, torch.uint8),
        (257, torch.uint16),
        (1 << 16, torch.uint16),
        ((1 << 16) + 1, torch.int32),
        (1 << 31, torch.int32),
        ((1 << 31) + 1, torch.int64),
    ],
)
def test_index_dtype_is_the_narrowest_that_holds_the_last_index(numel, dtype):
    assert wire_index_dtype(numel) == dtype
    info = torch.iinfo(dtype)
    assert info.min <= 0 and numel - 1 <= info.max


def _indices(numel: int, k: int, gen: torch.Generator) -> torch.Tensor:
    # the extremes of the range included: 0 and numel - 1
    middle = torch.randint(0, numel, (k - 2,), generator=gen, dtype=torch.int64)
    return torch.cat([torch.tensor([numel - 1, 0]), middle])


def test_layout_round_trip_is_exact_for_every_dtype_and_aligned():
    gen = torch.Generator().manual_seed(0)
    # mixed widths in an order that would misalign them if laid out as given
    numels = [200, (1 << 31) + 7, 70_000, 256, 1000, 3]
    ks = [5, 3, 7, 4, 9, 2]
    idxs = [_indices(n, k, gen) for n, k in zip(numels, ks, strict=True)]
    # the compressors hand over uint16 for small tensors: the layout takes any dtype
    idxs[4] = idxs[4].to(torch.uint16)
    lay = IndexLayout(numels, ks)
    assert lay.dtypes == [
        torch.uint8,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.uint16,
        torch.uint8,
    ]
    assert lay.nbytes == sum(k * d.itemsize for k, d in zip(ks, lay.dtypes, strict=True))
    data = lay.pack(idxs)
    assert data.dtype == torch.uint8 and data.numel() == lay.nbytes
    received = data.clone()  # a fresh buffer, as the all-gather delivers it
    for j, idx in enumerate(idxs):
        a, _ = lay.spans[j]
        assert a % lay.dtypes[j].itemsize == 0
        got = lay.unpack(received, j)
        assert got.dtype == lay.dtypes[j]
        assert torch.equal(got.long(), idx.long())


def test_empty_layout_and_mismatched_lengths():
    lay = IndexLayout([], [])
    assert lay.nbytes == 0 and lay.pack([]).numel() == 0
    with pytest.raises(ValueError, match="numels"):
        IndexLayout([4, 5], [1])


def test_wire_stats_roll_over_per_step():
    w = WireStats()
    w.add(3, 40, 10, 400, [torch.uint16], torch.bfloat16)
    w.add(3, 8, 2, 80, [torch.uint8], torch.bfloat16)
    d = w.as_dict()
    assert (d["wire_step"], d["wire_step_bytes"], d["wire_step_buckets"]) == (3, 60, 2)
    assert d["wire_index_dtypes"] == "uint8,uint16" and d["wire_value_dtypes"] == "bfloat16"
    w.add(4, 40, 10, 400, [torch.uint16], torch.bfloat16)
    d = w.as_dict()
    assert (d["wire_steps"], d["wire_bytes"], d["wire_dense_bytes"]) == (2, 110, 880)
    assert (d["wire_step"], d["wire_step_bytes"], d["wire_step_dense_bytes"]) == (4, 50, 400)
    assert d["wire_bytes_per_step"] == 55.0 and d["wire_index_dtypes"] == "uint16"


@pytest.mark.multiprocess
def test_index_bytes_survive_a_gloo_all_gather(one_rank_group):
    # gloo refuses int16/uint16 tensors; as bytes they pass and view back exactly
    with pytest.raises(Exception, match="(?i)invalid scalar type"):
        t = torch.zeros(2, dtype=torch.uint16)
        dist.all_gather([torch.empty_like(t)], t)
    gen = torch.Generator().manual_seed(1)
    numels, ks = [257, 300, 100], [4, 6, 3]
    idxs = [_indices(n, k, gen) for n, k in zip(numels, ks, strict=True)]
    lay = IndexLayout(numels, ks)
    data = lay.pack(idxs)
    out = [torch.empty_like(data)]
    dist.all_gather(out, data)
    for j, idx in enumerate(idxs):
        assert torch.equal(lay.unpack(out[0], j).long(), idx)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gradients_travel_unconverted_and_are_recorded_exactly(
    tmp_path, one_rank_group, dtype
):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))
    net = net.to(dtype)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ratio = 0.1
    with lowdiff.Checkpointer(
        tmp_path / "ck", model, opt, compressor=lowdiff.TopK(ratio), full_every=4
    ) as ck:
        ck.resume()
        hs = ck.strategy_impl.ddp_hook_state
        for step in range(3):
            x = torch.randn(8, 20, generator=torch.Generator().manual_seed(step)).to(dtype)
            model(x).float().pow(2).mean().backward()
            # the record of the step decompresses to exactly the .grad about to be applied
            for info, p in ck.strategy_impl.params:
                payload = hs.payloads[info.index]
                assert payload["values"].dtype == dtype
                got = ck.strategy_impl.compressor.decompress(payload, p.numel(), p.dtype)
                assert torch.equal(got, p.grad.reshape(-1))
            ck.step()
            opt.zero_grad()
        wire = hs.wire.as_dict()
    assert wire["wire_value_dtypes"] == str(dtype).removeprefix("torch.")
    assert wire["wire_steps"] == 3 and wire["wire_step"] == 2
    numels = [p.numel() for p in net.parameters()]  # 600, 30, 120, 4
    ks = [max(1, math.ceil(ratio * n)) for n in numels]
    index_size = [2 if n > 256 else 1 for n in numels]
    want = sum(k * (2 + s) for k, s in zip(ks, index_size, strict=True))
    assert wire["wire_step_bytes"] == want
    assert wire["wire_step_value_bytes"] == 2 * sum(ks)
    assert wire["wire_step_dense_bytes"] == 2 * sum(numels)
    assert wire["wire_index_dtypes"] == "uint8,uint16"
