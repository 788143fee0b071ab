"""Mapping between torch dtypes and the safetensors dtype names."""

from __future__ import annotations

import torch

from lowdiff.errors import ArgumentTypeError, InvalidArgumentError

_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors name of ``dtype`` (``torch.float32`` -> ``"F32"``)."""
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise ArgumentTypeError(f"lowdiff cannot store tensors of dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``ValueError`` for an unknown name."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown tensor dtype {name!r}") from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return torch.empty((), dtype=dtype).element_size()
