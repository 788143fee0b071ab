"""A JSON codec for the small, non-tensor state that travels with checkpoints.

Optimizer ``param_groups``, scheduler ``state_dict()`` and RNG bookkeeping are nested
Python values. lowdiff never pickles them: they are encoded as JSON with a few tagged
forms so that decoding gives back exactly the same values and types:

- tuples: ``{"__tuple__": [...]}``;
- dicts whose keys are not all strings: ``{"__dict__": [[key, value], ...]}``;
- non-finite floats: ``{"__float__": "nan" | "inf" | "-inf"}``;
- tensors: either ``{"__tensor_ref__": name}`` when a tensor sink is given (the tensor is
  stored in the safetensors payload under ``name``), or an inline
  ``{"__tensor__": {"dtype", "shape", "b64"}}`` for small tensors.

Floats round-trip exactly because JSON numbers are written with Python's shortest
``repr``. Anything else (functions, arbitrary objects) is rejected with a ``TypeError``
naming where in the tree it was found.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lowdiff.format.dtypes import dtype_from_name, dtype_name, itemsize

_TAGS = {"__tuple__", "__dict__", "__float__", "__tensor__", "__tensor_ref__", "__str_dict__"}

TensorSink = Callable[[str, torch.Tensor], str]
TensorSource = Callable[[str], torch.Tensor]


def encode(value: Any, sink: TensorSink | None = None, path: str = "$") -> Any:
    """Turn ``value`` into a JSON-compatible tree (see the module docstring).

    Without a tensor sink the tree is built by a walk that keeps no path (a record's
    scheduler state and hyperparameters are encoded at every step); a value it cannot
    store is then encoded again the slow way, whose error names where it is.
    """
    if sink is None:
        try:
            return _encode_plain(value)
        except (TypeError, RecursionError):
            pass  # encoded again below: the error names the path
    return _encode(value, sink, path)


def _encode_plain(value: Any) -> Any:
    """:func:`encode` without a tensor sink, for the exact built-in types; any other
    value goes through :func:`_encode` (which gives the same tree)."""
    t = type(value)
    if t is str or t is bool or t is int or value is None:
        return value
    if t is float:
        return value if math.isfinite(value) else _encode(value, None, "$")
    if t is dict:
        if all(type(k) is str for k in value) and _TAGS.isdisjoint(value):
            return {k: _encode_plain(v) for k, v in value.items()}
        return _encode(value, None, "$")
    if t is list:
        return [_encode_plain(v) for v in value]
    if t is tuple:
        return {"__tuple__": [_encode_plain(v) for v in value]}
    return _encode(value, None, "$")


def _encode(value: Any, sink: TensorSink | None, path: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if sink is not None:
            return {"__tensor_ref__": sink(path, t)}
        t = t.cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "b64": base64.b64encode(raw).decode("ascii"),
            }
        }
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, sink, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, sink, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            if any(k in _TAGS for k in value):
                # a user dict that happens to use a tag name as a key: escape it
                return {
                    "__str_dict__": [[k, _encode(v, sink, f"{path}.{k}")] for k, v in value.items()]
                }
            return {k: _encode(v, sink, f"{path}.{k}") for k, v in value.items()}
        return {
            "__dict__": [
                [_encode(k, None, f"{path}.<key>"), _encode(v, sink, f"{path}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    raise TypeError(
        f"lowdiff cannot store {type(value).__name__} at {path}: only numbers, strings, "
        "None, bools, lists, tuples, dicts and tensors are supported (no pickle)"
    )


def decode(tree: Any, source: TensorSource | None = None) -> Any:
    """Inverse of :func:`encode`. A malformed tree raises ``ValueError``, whatever is wrong."""
    try:
        return _decode(tree, source)
    except ValueError:
        raise
    except (KeyError, IndexError, TypeError, AttributeError, RecursionError, OverflowError) as e:
        raise ValueError(f"malformed lowdiff metadata ({type(e).__name__}: {e})") from None


def _decode(tree: Any, source: TensorSource | None) -> Any:
    if isinstance(tree, list):
        return [_decode(v, source) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, body),) = tree.items()
        if tag == "__tuple__":
            return tuple(_decode(v, source) for v in body)
        if tag == "__dict__":
            return {_hashable(_decode(k, None)): _decode(v, source) for k, v in body}
        if tag == "__str_dict__":
            return {k: _decode(v, source) for k, v in body}
        if tag == "__float__":
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[body]
        if tag == "__tensor_ref__":
            if source is None:
                raise ValueError("tensor reference without a tensor source")
            return source(body)
        if tag == "__tensor__":
            dtype = dtype_from_name(body["dtype"])
            raw = bytearray(base64.b64decode(body["b64"], validate=True))
            shape = [int(s) for s in body["shape"]]
            numel = math.prod(shape)
            # a forged shape must not allocate more than the bytes that are really there
            if any(s < 0 for s in shape) or numel * itemsize(dtype) != len(raw):
                raise ValueError(
                    f"inline tensor of shape {shape} and dtype {body['dtype']} cannot hold "
                    f"{len(raw)} bytes"
                )
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
    return {k: _decode(v, source) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


def dumps(value: Any, sink: TensorSink | None = None) -> str:
    """``encode`` then compact, key-sorted JSON text."""
    return json.dumps(encode(value, sink), sort_keys=True, separators=(",", ":"), allow_nan=False)


def loads(text: str, source: TensorSource | None = None) -> Any:
    """Inverse of :func:`dumps`. Malformed text raises ``ValueError``, whatever is wrong."""
    try:
        tree = json.loads(text)
    except RecursionError:
        raise ValueError("malformed lowdiff metadata (nested too deeply)") from None
    return decode(tree, source)
