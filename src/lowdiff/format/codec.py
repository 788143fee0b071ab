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
import operator
from collections.abc import Callable, Mapping
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any

import torch

from lowdiff.errors import ArgumentTypeError, InvalidArgumentError
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
    raise ArgumentTypeError(
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
        raise InvalidArgumentError(f"malformed lowdiff metadata ({type(e).__name__}: {e})") from None


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
                raise InvalidArgumentError("tensor reference without a tensor source")
            return source(body)
        if tag == "__tensor__":
            dtype = dtype_from_name(body["dtype"])
            raw = bytearray(base64.b64decode(body["b64"], validate=True))
            shape = [int(s) for s in body["shape"]]
            numel = math.prod(shape)
            # a forged shape must not allocate more than the bytes that are really there
            if any(s < 0 for s in shape) or numel * itemsize(dtype) != len(raw):
                raise InvalidArgumentError(
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
        raise InvalidArgumentError("malformed lowdiff metadata (nested too deeply)") from None
    return decode(tree, source)


_LEAVES = (float, int, bool, str, type(None))
_UNSET: Any = object()


def _is_leaf(value: Any) -> bool:
    """A value that cannot change in place: a number, string, None or tuple of these."""
    t = type(value)
    if t is tuple:
        return all(_is_leaf(v) for v in value)
    return t in _LEAVES


def _leaf_text(value: Any, t: type) -> str:
    """``dumps(value)``, directly for a number, string, bool or None (the text
    ``json.dumps`` writes for them)."""
    if t is float:
        return float.__repr__(value) if math.isfinite(value) else dumps(value)
    if t is int:
        return int.__repr__(value)
    if t is str:
        return _json_str(value)
    if t is bool:
        return "true" if value else "false"
    if value is None:
        return "null"
    return dumps(value)


class DumpsMemo:
    """:func:`dumps` of a value that changes a little from call to call (a scheduler's
    ``state_dict()``, an optimizer's hyperparameters: once per training step), encoding
    again only the parts that changed. ``memo(value) == dumps(value)`` at every call.

    A part is reused by identity: a number, string, ``None`` or tuple of these that is
    the very same object as at the previous call has the same text (the memo keeps the
    objects alive, so no other value can take their identity). Dicts with string keys
    and lists are walked, so a list or dict changed in place is seen; anything else (a
    tensor, a dict with other keys) is encoded at every call.
    """

    __slots__ = ("_children", "_keys", "_keytexts", "_kind", "_obj", "_order", "_text", "_vals")

    def __init__(self) -> None:
        self._kind: type | None = None
        self._obj: Any = _UNSET
        self._text = ""
        self._keys: tuple[str, ...] | None = None
        self._vals: tuple[Any, ...] | None = None
        self._order: list[int] = []
        self._keytexts: list[str] = []
        self._children: list[DumpsMemo] = []

    def __call__(self, value: Any) -> str:
        try:
            return self._encode(value)
        except TypeError:
            return dumps(value)  # raises again, naming where in the tree

    def _encode(self, value: Any) -> str:
        if value is self._obj:
            return self._text
        t = type(value)
        if t is dict:
            return self._dict(value)
        if t is list:
            return self._list(value)
        self._kind = None
        text = _leaf_text(value, t)
        if _is_leaf(value):
            self._obj, self._text = value, text
        else:
            self._obj = _UNSET
        return text

    def _dict(self, d: dict[Any, Any]) -> str:
        self._obj = _UNSET  # a container: its parent walks it again at every call
        keys = tuple(d)
        vals = tuple(d.values())
        if self._kind is not dict or keys != self._keys:
            if not all(type(k) is str for k in keys) or not _TAGS.isdisjoint(keys):
                self._kind = None
                return dumps(d)
            self._kind, self._keys, self._vals = dict, keys, None
            self._order = sorted(range(len(keys)), key=keys.__getitem__)
            self._keytexts = [json.dumps(keys[i]) + ":" for i in self._order]
            self._children = [DumpsMemo() for _ in keys]
        elif self._vals is not None and all(map(operator.is_, vals, self._vals)):
            return self._text  # every value the same immutable object as before
        ch = self._children
        text = (
            "{"
            + ",".join(
                [
                    kt + ch[i]._encode(vals[i])
                    for kt, i in zip(self._keytexts, self._order, strict=True)
                ]
            )
            + "}"
        )
        leaves = all(c._obj is not _UNSET for c in ch)
        self._vals, self._text = (vals, text) if leaves else (None, "")
        return text

    def _list(self, lst: list[Any]) -> str:
        self._obj = _UNSET
        ch = self._children
        if self._kind is not list or len(ch) != len(lst):
            self._kind, self._keys = list, None
            ch = self._children = [DumpsMemo() for _ in lst]
        return "[" + ",".join([c._encode(x) for c, x in zip(ch, lst, strict=True)]) + "]"
