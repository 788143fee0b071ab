"""The compressor contract.

A compressor turns the flat gradient of one parameter into a small, fixed-layout
payload and back. The call sequence, all on the training process unless noted:

0) ``fields(numel, dtype)`` once per parameter when the Checkpointer starts: the exact
   layout (names, dtypes, element counts) of every payload this compressor will ever
   return for a gradient of that size. The layout never depends on the gradient values,
   so records have a fixed size and can be written into pre-allocated shared memory.
1) ``compress(grad, key, step)`` every step, for every parameter that has a gradient.
   ``grad`` is the 1-D contiguous gradient; ``key`` is the parameter's stable index in
   the optimizer; ``step`` is the optimizer step the gradient belongs to. With error
   feedback on, the compressor adds its residual for ``key`` first and keeps the new
   residual. It never modifies ``grad`` and never draws from the global RNG (seeded
   private generators only), so checkpointing does not change the training trajectory.
2) ``decompress(payload, numel, dtype)`` right after, on the training process, and again
   at recovery in any process. It is a pure, deterministic function of the payload: this
   is what makes replay bit-exact. The training process writes its result into ``.grad``.
3) ``reset_state()`` at recovery: the error-feedback residuals are dense training state
   that no record carries, so a resumed run starts them at zero.

``spec()`` is the JSON-serialisable configuration; ``compressor_from_spec`` rebuilds a
compressor from it, so a recovery process can decompress records without the original
object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowdiff.errors import ArgumentTypeError, InvalidArgumentError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class FieldSpec:
    """One tensor of a compressed payload."""

    name: str
    """Field name, unique within one payload (e.g. ``"values"``, ``"indices"``)."""
    dtype: torch.dtype
    """Element type of the field."""
    numel: int
    """Exact number of elements."""


def index_dtype_for(numel: int) -> torch.dtype:
    """The narrowest integer dtype that can hold every index of a tensor of ``numel`` elements."""
    if numel <= 1 << 16:
        return torch.uint16
    if numel <= 1 << 31:
        return torch.int32
    return torch.int64


def derive_seed(seed: int, step: int, key: int, salt: int = 0) -> int:
    """Mix ``(seed, step, key, salt)`` into one 63-bit seed for a private ``torch.Generator``.

    Nearby inputs (consecutive steps or keys) give unrelated seeds, so the streams of
    different parameters and steps do not overlap. Pure Python: the result is the same in
    every process and on every platform, which recovery relies on.
    """
    state = 0x9E3779B97F4A7C15
    for value in (seed, step, key, salt):
        # SplitMix64 finaliser over the running state; masking keeps negatives well-defined.
        state = (state ^ (value & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1


def seeded_generator(
    seed: int, step: int, key: int, salt: int, device: torch.device
) -> torch.Generator:
    """A fresh private generator on ``device`` seeded from ``derive_seed(seed, step, key, salt)``.

    Compressors draw from these and never from the global RNG, so checkpointing does not
    perturb the training trajectory. A fresh generator costs a few microseconds and keeps
    concurrent ``compress`` calls from sharing generator state.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, step, key, salt))
    return gen


def check_flat_grad(who: str, grad: torch.Tensor) -> None:
    """Raise unless ``grad`` is a 1-D contiguous floating-point tensor."""
    if not isinstance(grad, torch.Tensor):
        raise ArgumentTypeError(f"{who}: grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dim() != 1 or not grad.is_contiguous():
        raise InvalidArgumentError(
            f"{who}: grad must be 1-D and contiguous, got shape {tuple(grad.shape)} "
            f"(contiguous={grad.is_contiguous()})"
        )
    if not grad.is_floating_point():
        raise ArgumentTypeError(f"{who}: grad must be floating point, got {grad.dtype}")


def check_payload(who: str, payload: Mapping[str, torch.Tensor], fields: list[FieldSpec]) -> None:
    """Raise ``ValueError`` unless ``payload`` holds every field of ``fields`` exactly.

    Extra keys are ignored; each listed field must be a 1-D tensor of the listed dtype and
    element count.
    """
    for f in fields:
        t = payload.get(f.name)
        if t is None:
            raise InvalidArgumentError(f"{who}: payload has no field {f.name!r}; has {sorted(payload)}")
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != f.dtype
            or t.dim() != 1
            or t.numel() != f.numel
        ):
            got = (
                f"{t.dtype} shape {tuple(t.shape)}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            raise InvalidArgumentError(
                f"{who}: payload field {f.name!r} must be a 1-D {f.dtype} tensor of "
                f"{f.numel} elements, got {got}"
            )


class Compressor(ABC):
    """Base class of every gradient compressor (see the module docstring for the contract)."""

    kind: ClassVar[str]
    """Registry name, stored in checkpoints (e.g. ``"topk"``)."""

    error_feedback: bool = False

    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """JSON-serialisable configuration, including ``"kind"``."""

    @abstractmethod
    def fields(self, numel: int, dtype: torch.dtype) -> list[FieldSpec]:
        """Exact payload layout for a flat gradient of ``numel`` elements of ``dtype``."""

    @abstractmethod
    def compress(self, grad: torch.Tensor, key: int, step: int) -> dict[str, torch.Tensor]:
        """Compress a 1-D contiguous gradient. Returns tensors matching ``fields`` exactly."""

    @abstractmethod
    def decompress(
        self, payload: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Dense 1-D gradient of ``numel`` elements of ``dtype``; pure and deterministic."""

    def decompress_into(self, payload: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        """Write the dense gradient into ``out`` (1-D, contiguous), bit for bit what
        :meth:`decompress` returns; compressors override it to skip the dense temporary."""
        out.copy_(self.decompress(payload, out.numel(), out.dtype))

    def decompress_many(
        self,
        payloads: Sequence[Mapping[str, torch.Tensor]],
        numels: Sequence[int],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The dense gradients of several payloads of one ``dtype`` end to end in one 1-D
        tensor (gradient ``i`` from ``sum(numels[:i])``), bit for bit what
        :meth:`decompress` returns for each. Recovery decodes a record this way;
        compressors override it to do so in a few operations instead of a few per
        gradient."""
        device = next((t.device for p in payloads for t in p.values()), torch.device("cpu"))
        out = torch.empty(sum(numels), dtype=dtype, device=device)
        off = 0
        for payload, n in zip(payloads, numels, strict=True):
            self.decompress_into(payload, out[off : off + n])
            off += n
        return out

    def reset_state(self) -> None:  # noqa: B027 - optional hook; stateless compressors keep it
        """Drop all error-feedback residuals (called at recovery)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.spec().items() if k != "kind")
        return f"{type(self).__name__}({args})"


_REGISTRY: dict[str, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make ``cls`` constructible from its ``spec()``."""
    _REGISTRY[cls.kind] = cls
    return cls


def compressor_from_spec(spec: Mapping[str, Any]) -> Compressor:
    """Rebuild a compressor from ``spec()`` output (the ``kind`` key picks the class)."""
    kind = spec.get("kind")
    if kind not in _REGISTRY:
        raise InvalidArgumentError(f"unknown compressor kind {kind!r}; known: {sorted(_REGISTRY)}")
    kwargs = {k: v for k, v in spec.items() if k != "kind"}
    return _REGISTRY[kind](**kwargs)


@register
class NoCompression(Compressor):
    """The identity "compressor": the payload is the dense gradient itself.

    Used by ``strategy="lowdiff+"``, whose records are uncompressed gradient snapshots.

    Example:
        >>> NoCompression().fields(10, torch.float32)
        [FieldSpec(name='values', dtype=torch.float32, numel=10)]
    """

    kind = "none"

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def fields(self, numel: int, dtype: torch.dtype) -> list[FieldSpec]:
        return [FieldSpec("values", dtype, numel)]

    def compress(self, grad: torch.Tensor, key: int, step: int) -> dict[str, torch.Tensor]:
        return {"values": grad}

    def decompress(
        self, payload: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return payload["values"].to(dtype).clone()

    def decompress_into(self, payload: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        values = payload["values"]
        if values.data_ptr() != out.data_ptr():  # compress() hands back the gradient itself
            out.copy_(values)
