"""``codec.DumpsMemo`` gives ``codec.dumps``'s text at every call, whatever changed
between calls (in place, by assignment, in type), and reuses what did not change."""

from __future__ import annotations

import random

import pytest
import torch

from lowdiff.format import codec


def _states():
    """A scheduler-like state changed a little at each step, in every way a state can."""
    d = {
        "last_epoch": 0,
        "_last_lr": [0.1, 0.2],
        "base_lrs": [0.1, 0.2],
        "betas": (0.9, 0.999),
        "_schedulers": [{"last_epoch": 0, "gamma": 0.5}, {"T_max": 10, "eta_min": 0.0}],
        "name": "x",
        "flag": None,
    }
    yield d
    d["last_epoch"] = 1  # assigned
    yield d
    d["_last_lr"] = [0.05, 0.2]  # a new list
    yield d
    d["base_lrs"][0] = 0.3  # a list changed in place
    yield d
    d["_schedulers"][1]["eta_min"] = 1e-3  # a nested dict changed in place
    yield d
    d["betas"] = (0.8, 0.999)  # a new tuple
    yield d
    d["new_key"] = {"a": 1}  # a key added
    yield d
    del d["flag"]  # and one removed
    yield d
    d["_last_lr"].append(0.4)  # a list that grows
    yield d
    d["name"] = 3  # a leaf changes type
    yield d
    d["name"] = {"now": ["a dict"]}  # a leaf becomes a container
    yield d
    d["name"]["now"][0] = "changed in place"  # and then changes in place
    yield d
    d["name"] = "a leaf again"
    yield d
    d["nan"] = float("nan")  # tagged forms
    d["inf"] = -float("inf")
    yield d
    d["t"] = torch.arange(3.0)  # a tensor is encoded at every call
    yield d
    d["t"].add_(1)
    yield d
    d["intkeys"] = {1: "a", 2: "b"}  # non-string keys
    yield d
    d["intkeys"][3] = "c"
    yield d
    d["tagged"] = {"__tuple__": 1}  # a key that is a tag name
    yield d
    d["tagged"]["__tuple__"] = 2
    yield d
    d["neg"] = -0.0
    yield d
    d["neg"] = 0.0
    yield d
    yield [d, d]  # the root changes type
    yield 5
    yield d


def test_memo_equals_dumps_through_every_kind_of_change():
    memo = codec.DumpsMemo()
    for i, value in enumerate(_states()):
        assert memo(value) == codec.dumps(value), i


def test_memo_equals_dumps_under_random_changes():
    rng = random.Random(0)
    leaves = [0, 1, -1, 2.5, -0.0, 1e300, None, True, False, "s", "é", (1, 2.0), ()]

    def value(depth: int):
        r = rng.random()
        if depth > 2 or r < 0.5:
            return rng.choice(leaves)
        if r < 0.75:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice("abcde"): value(depth + 1) for _ in range(rng.randrange(4))}

    def mutate(v, depth=0):
        if isinstance(v, dict) and v and rng.random() < 0.7:
            k = rng.choice(list(v))
            if rng.random() < 0.5:
                v[k] = mutate(v[k], depth + 1)
            else:
                v[rng.choice("abcdef")] = value(depth + 1)
            return v
        if isinstance(v, list) and v and rng.random() < 0.7:
            i = rng.randrange(len(v))
            v[i] = mutate(v[i], depth + 1)
            return v
        return value(depth)

    for _ in range(50):
        memo = codec.DumpsMemo()
        v = {"root": value(0)}
        for _ in range(30):
            assert memo(v) == codec.dumps(v)
            v = mutate(v)


def test_memo_reuses_the_text_of_what_did_not_change(monkeypatch):
    memo = codec.DumpsMemo()
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "name": "decay"}, {"lr": 0.2}]
    memo(groups)
    calls = []
    leaf = codec._leaf_text
    monkeypatch.setattr(codec, "_leaf_text", lambda v, t: calls.append(v) or leaf(v, t))
    assert memo(groups) == codec.dumps(groups)
    assert calls == []  # nothing changed: nothing encoded
    groups[0]["lr"] = 0.05
    assert memo(groups) == codec.dumps(groups)
    assert calls == [0.05]  # only the new value


@pytest.mark.parametrize("bad", [{"f": print}, [object()]])
def test_memo_raises_what_dumps_raises(bad):
    with pytest.raises(TypeError) as want:
        codec.dumps(bad)
    with pytest.raises(TypeError) as got:
        codec.DumpsMemo()(bad)
    assert str(got.value) == str(want.value)
