"""Quantising compressors: every entry kept, each in fewer bits."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from lowdiff.compressors.base import (
    Compressor,
    FieldSpec,
    check_flat_grad,
    check_payload,
    register,
    seeded_generator,
)
from lowdiff.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["QSGD"]

_LEVELS = 127
"""Largest code magnitude of 8-bit QSGD; -128 is never produced, keeping codes symmetric."""


def _check_int(who: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{who}: {name} must be an int, got {value!r}")
    result = int(value)
    if result < minimum:
        raise InvalidArgumentError(f"{who}: {name} must be >= {minimum}, got {value!r}")
    return result


@register
class QSGD(Compressor):
    """8-bit QSGD: per-bucket max scaling with unbiased stochastic rounding.

    For each bucket of ``bucket_size`` consecutive entries, ``scale = max |x|`` (fp32) and
    ``code = sign(x) * floor(|x| / scale * 127 + u)`` with ``u ~ U[0, 1)`` drawn from a
    private generator seeded by ``(seed, step, key)``. Decompression is
    ``code * (scale / 127)``, within ``scale / 127`` of the input. The payload is
    ``"codes"`` (int8, ``numel``) and ``"scales"`` (float32, ``ceil(numel / bucket_size)``),
    about 1 + 4 / bucket_size bytes per parameter. There is no error feedback: the rounding
    is unbiased, so there is nothing to carry.

    Args:
        bits: Code width; only 8 is supported.
        bucket_size: Entries sharing one scale (the last bucket may be shorter).
        seed: Seeds the private rounding generator together with ``(step, key)``.

    Example:
        >>> import torch
        >>> c = QSGD(bucket_size=4)
        >>> x = torch.tensor([1.0, -0.5, 0.25, 0.0, 0.0, 0.0])
        >>> p = c.compress(x, key=0, step=0)
        >>> p["scales"]
        tensor([1., 0.])
        >>> bool((c.decompress(p, 6, torch.float32) - x).abs().max() <= 1 / 127)
        True
    """

    kind = "qsgd"
    error_feedback = False
    _SALT = 0x05B5_6D08

    def __init__(self, bits: int = 8, bucket_size: int = 512, seed: int = 0) -> None:
        bits = _check_int("QSGD", "bits", bits, 1)
        if bits != 8:
            raise InvalidArgumentError(f"QSGD: bits must be 8 (the only supported width), got {bits!r}")
        self.bits: int = bits
        self.bucket_size: int = _check_int("QSGD", "bucket_size", bucket_size, 1)
        self.seed: int = _check_int("QSGD", "seed", seed, 0)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "bits": self.bits,
            "bucket_size": self.bucket_size,
            "seed": self.seed,
        }

    def n_buckets(self, numel: int) -> int:
        """Number of scales stored for a gradient of ``numel`` elements."""
        return math.ceil(numel / self.bucket_size)

    def fields(self, numel: int, dtype: torch.dtype) -> list[FieldSpec]:
        _check_int("QSGD", "numel", numel, 0)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ArgumentTypeError(f"QSGD: dtype must be a floating-point torch.dtype, got {dtype!r}")
        return [
            FieldSpec("codes", torch.int8, numel),
            FieldSpec("scales", torch.float32, self.n_buckets(numel)),
        ]

    def compress(self, grad: torch.Tensor, key: int, step: int) -> dict[str, torch.Tensor]:
        check_flat_grad("QSGD", grad)
        numel = grad.numel()
        n_buckets = self.n_buckets(numel)
        padded = n_buckets * self.bucket_size
        device = grad.device

        # |x| in fp32, zero-padded to whole buckets (zeros never raise a bucket's max). The
        # caller's gradient is only read, so no defensive copy of it is needed.
        level = torch.empty(padded, dtype=torch.float32, device=device)
        if grad.dtype == torch.float32:
            torch.abs(grad, out=level[:numel])
        else:
            level[:numel].copy_(grad).abs_()
        level[numel:].zero_()
        buckets = level.view(n_buckets, self.bucket_size)

        scales = buckets.amax(dim=1)
        # Dividing an all-zero bucket by 1 instead of 0 keeps its codes at 0 rather than NaN.
        buckets.div_(scales.masked_fill(scales == 0, 1.0).unsqueeze(1)).mul_(_LEVELS)
        gen = seeded_generator(self.seed, step, key, self._SALT, device)
        noise = torch.rand(buckets.shape, generator=gen, dtype=torch.float32, device=device)
        # |x| / scale * 127 <= 127 exactly, but adding u can round up to 128. Float-to-int
        # conversion truncates toward zero, which is floor for the non-negative magnitude and
        # so gives sign(x) * floor(...) after copysign, without a separate floor pass.
        buckets.add_(noise).clamp_(max=_LEVELS)
        magnitude = level[:numel]
        magnitude.copysign_(grad)
        codes = magnitude.to(torch.int8)
        return {"codes": codes, "scales": scales}

    def decompress(
        self, payload: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        check_payload("QSGD", payload, self.fields(numel, dtype))
        out = payload["codes"].to(torch.float32)
        steps = payload["scales"] / _LEVELS
        full = numel // self.bucket_size
        if full:
            body = out[: full * self.bucket_size].view(full, self.bucket_size)
            body.mul_(steps[:full].unsqueeze(1))
        if full * self.bucket_size < numel:
            out[full * self.bucket_size :].mul_(steps[full])
        return out if dtype == torch.float32 else out.to(dtype)
