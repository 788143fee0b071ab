from __future__ import annotations

import math
from collections import OrderedDict

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


# -- the plain walk (no tensor sink) gives the tree of the path-keeping one -------------


class _Key(int):
    """An int subclass (as IntEnum is): encoded as a plain int."""


def _leaves():
    from hypothesis import strategies as hs

    return hs.one_of(
        hs.none(),
        hs.booleans(),
        hs.integers(),
        hs.floats(allow_nan=True, allow_infinity=True),
        hs.text(max_size=5),
        hs.sampled_from(["__tuple__", "__dict__", "__float__", "__str_dict__"]),
        hs.integers(-5, 5).map(_Key),
        hs.integers(0, 3).map(lambda n: torch.arange(n, dtype=torch.float32)),
    )


def _trees():
    from collections import OrderedDict

    from hypothesis import strategies as hs

    keys = hs.one_of(hs.text(max_size=4), hs.sampled_from(["__tuple__", "__float__"]))
    return hs.recursive(
        _leaves(),
        lambda kids: hs.one_of(
            hs.lists(kids, max_size=4),
            hs.lists(kids, max_size=4).map(tuple),
            hs.dictionaries(keys, kids, max_size=4),
            hs.dictionaries(hs.integers(-3, 3), kids, max_size=3),
            hs.dictionaries(keys, kids, max_size=3).map(OrderedDict),
        ),
        max_leaves=20,
    )


def _same(a, b) -> bool:
    """Equal trees, NaN included (a float leaf is compared by its repr)."""
    if isinstance(a, float) and isinstance(b, float):
        return repr(a) == repr(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_the_plain_walk_builds_the_same_tree_as_the_path_keeping_one():
    from hypothesis import given, settings

    @settings(max_examples=300, deadline=None)
    @given(_trees())
    def check(value):
        fast = codec.encode(value)
        slow = codec._encode(value, None, "$")
        assert _same(fast, slow)
        assert codec.dumps(value) == codec.dumps(value)  # deterministic
        back = codec.loads(codec.dumps(value))
        assert codec.dumps(back) == codec.dumps(value)

    check()
    # every form the plain walk hands to the path-keeping one, in one tree
    mixed = {
        "t": (1, [2.5, None]),
        "tag": {"__tuple__": 1},
        "ints": {3: "x"},
        "od": OrderedDict(a=1),
        "k": _Key(4),
        "nan": math.nan,
        "w": torch.ones(2),
    }
    assert _same(codec.encode(mixed), codec._encode(mixed, None, "$"))
    assert codec.encode(mixed)["tag"] == {"__str_dict__": [["__tuple__", 1]]}


def test_a_value_that_cannot_be_stored_is_named_by_its_path_on_the_plain_walk():
    with pytest.raises(TypeError, match=r"cannot store object at \$\.sched\[1\]\.x"):
        codec.encode({"sched": [1, {"x": object()}]})
    with pytest.raises(TypeError, match=r"cannot store function at \$\.a\[0\]"):
        codec.encode({"a": (lambda: 0,)})
