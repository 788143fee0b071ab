from __future__ import annotations

import math

import pytest
import torch

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import codec, layout


def test_manifest_round_trip_and_any_byte_change_is_detected(tmp_path):
    body = {
        "format": "lowdiff",
        "compressor": {"kind": "topk", "ratio": 0.01},
        "n": [1, 2.5, None, True],
    }
    layout.write_manifest(tmp_path, body)
    assert layout.read_manifest(tmp_path) == body
    raw = (tmp_path / layout.MANIFEST).read_bytes()
    undetected = 0
    for i in range(len(raw)):
        for mask in (0x01, 0x2A):
            bad = bytearray(raw)
            bad[i] ^= mask
            (tmp_path / layout.MANIFEST).write_bytes(bytes(bad))
            try:
                layout.read_manifest(tmp_path)
                undetected += 1
            except CorruptCheckpointError:
                pass
    assert undetected == 0


def test_manifest_names_itself_when_torn(tmp_path):
    layout.write_manifest(tmp_path, {"a": 1})
    raw = (tmp_path / layout.MANIFEST).read_bytes()
    (tmp_path / layout.MANIFEST).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptCheckpointError, match=layout.MANIFEST):
        layout.read_manifest(tmp_path)


def test_codec_round_trips_types_exactly():
    value = {
        "lr": 0.1 + 0.2,
        "betas": (0.9, 0.999),
        "nested": [1, (2, 3.0), {"x": None}],
        "state": {0: {"step": torch.tensor(3.0)}, 1: {}},
        "inf": math.inf,
        "ninf": -math.inf,
        "flag": False,
        "__tuple__": "a user key that looks like a tag",
        "t": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "b": torch.tensor([1.5], dtype=torch.bfloat16),
    }
    back = codec.loads(codec.dumps(value))
    assert back["lr"] == value["lr"] and isinstance(back["betas"], tuple)
    assert back["nested"] == [1, (2, 3.0), {"x": None}]
    assert set(back["state"]) == {0, 1} and torch.equal(back["state"][0]["step"], torch.tensor(3.0))
    assert back["inf"] == math.inf and back["ninf"] == -math.inf and back["flag"] is False
    assert back["__tuple__"] == value["__tuple__"]
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.int16
    assert torch.equal(back["b"], value["b"]) and back["b"].dtype == torch.bfloat16
    nan = codec.loads(codec.dumps({"x": math.nan}))["x"]
    assert math.isnan(nan)


def test_codec_refuses_what_it_cannot_store_and_says_where():
    with pytest.raises(TypeError, match=r"\$\.sched\.fn"):
        codec.dumps({"sched": {"fn": lambda x: x}})


def test_codec_tensor_sink_references():
    store = {}

    def sink(path, t):
        store[path] = t
        return path

    text = codec.dumps({"state": {0: {"exp_avg": torch.ones(3)}}}, sink)
    assert "exp_avg" in text and "b64" not in text
    back = codec.loads(text, store.__getitem__)
    assert torch.equal(back["state"][0]["exp_avg"], torch.ones(3))
