"""Bytes on the wire: lowdiff's DDP exchange against a dense all-reduce (2 gloo ranks)."""

from __future__ import annotations

import json
import math

import pytest

from lowdiff_lab.bench.wire import ddp_wire_bench
from lowdiff_lab.workloads.zoo import build_workload

RATIO = 0.01


def _expected_bytes(name: str) -> tuple[int, int, set[str]]:
    """(sparse bytes, dense bytes, index dtypes) of one rank's step, computed by hand: k
    float32 values per parameter, plus k indices of 1, 2 or 4 bytes as the parameter has at
    most 2**8, at most 2**16 or more elements."""
    sparse = dense = 0
    dtypes = set()
    for p in build_workload(name, seed=0).model.parameters():
        n = p.numel()
        k = min(n, max(1, math.ceil(RATIO * n)))
        size, dtype = (1, "uint8") if n <= 256 else (2, "uint16") if n <= 65536 else (4, "int32")
        sparse += k * (4 + size)
        dense += 4 * n
        dtypes.add(dtype)
    return sparse, dense, dtypes


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_rank_exchange_sends_what_the_ratio_and_dtypes_say():
    said: list[str] = []
    rows = ddp_wire_bench(
        workload="gpt2-tiny", world_size=2, ratio=RATIO, steps=2, progress=said.append
    )
    assert said and "gpt2-tiny" in said[0]
    assert [(r["step"], r["rank"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    sparse, dense, dtypes = _expected_bytes("gpt2-tiny")
    # gpt2-tiny's parameters are at most 2**16 elements: no index needs 4 bytes
    assert dtypes == {"uint8", "uint16"}
    for r in rows:
        json.dumps(r)  # flat and JSON-able
        assert all(not isinstance(v, dict | list) for v in r.values())
        assert r["lowdiff_bytes"] == sparse
        assert r["lowdiff_bytes"] == r["lowdiff_value_bytes"] + r["lowdiff_index_bytes"]
        assert r["dense_payload_bytes"] == r["dense_bucket_bytes"] == dense
        # ring algorithms at 2 ranks: the all-gather sends one contribution, the
        # all-reduce 2 (n - 1) / n = 1 payload
        assert r["lowdiff_ring_bytes"] == sparse and r["dense_ring_bytes"] == dense
        assert r["lowdiff_over_dense"] == pytest.approx(sparse / dense)
        assert r["lowdiff_bytes"] < r["dense_payload_bytes"]
        assert r["index_dtypes"] == "uint8,uint16"
        assert r["value_dtype"] == "float32"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="workload"):
        ddp_wire_bench(workload="no-such-model")
    with pytest.raises(ValueError, match="world_size"):
        ddp_wire_bench(world_size=0)
    with pytest.raises(ValueError, match="ratio"):
        ddp_wire_bench(ratio=1.5)
    with pytest.raises(ValueError, match="steps"):
        ddp_wire_bench(steps=0)
