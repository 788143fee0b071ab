"""A model zoo of benchmark workloads: GPT-2, BERT, ResNet and Qwen3, built from configs.

Every workload is a model plus its data and loss, behind one small object
(:class:`Workload`), so the benchmark can sweep the checkpointing strategies over
models of very different shapes without knowing any of them:

>>> w = build_workload("gpt2-s-tiny", seed=0)
>>> w.model.zero_grad(set_to_none=True)
>>> loss = w.forward_backward(step=0)  # grads are now in w.model's .grad fields

Families and their objectives:

- ``gpt2``: ``GPT2LMHeadModel``, next-byte prediction on the standard-library byte
  corpus of :mod:`lowdiff_lab.workloads.text`. ``gpt2-demo``, ``gpt2-tiny`` and ``gpt2-3m``
  are the models of :mod:`lowdiff_lab.workloads.models`, built by its ``build_model`` and scored by
  its ``lm_loss``, so they match the demo's training job bit for bit.
- ``bert``: ``BertForMaskedLM``, masked-LM on the same corpus: exactly
  :data:`MASK_FRACTION` of the positions of every sequence are chosen (a fixed count per
  sequence, so every micro-batch's mean loss has the same denominator and gradient
  accumulation equals a larger batch), and of those 80% become :data:`MASK_ID`, 10% a
  random byte and 10% stay.
- ``resnet``: ``ResNetForImageClassification`` on generated images: class ``k`` is a
  fixed oriented stripe pattern with its own tint and frequency; each image adds a
  random phase, contrast and Gaussian noise. No files and no downloads.
- ``qwen3``: ``Qwen3ForCausalLM``, next-byte prediction like ``gpt2``.

Byte tokens (0..255) are valid ids of every vocabulary, so the full-size models keep
their published vocabularies (and so their published parameter counts) while training on
bytes; the ``-tiny`` variants shrink the vocabulary along with everything else.

Every transformer uses the "eager" attention implementation: plain matmul + softmax,
bit-reproducible on CPU for a fixed thread count (see :mod:`lowdiff_lab.workloads.models`).
Weights are always initialised on the CPU from the global RNG seeded with ``seed`` and
then moved to the target device, so a workload starts from the same weights on every
device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lowdiff_lab.workloads import models, text
from lowdiff_lab.workloads.batches import MASK_FRACTION, MASK_ID, masked_lm_inputs, stripe_images
from lowdiff_lab.workloads.specs import (
    WORKLOADS,
    Family,
    WorkloadSpec,
    workload_names,
    workload_spec,
)

__all__ = [
    "MASK_FRACTION",
    "MASK_ID",
    "WORKLOADS",
    "Workload",
    "WorkloadSpec",
    "build_workload",
    "count_parameters_meta",
    "workload_names",
]

AMP_MODES = ("bf16", "fp16")
"""Accepted values of ``amp`` besides ``None``."""

_MIN_IMAGE_SIZE = 32
"""Smallest image side a ResNet workload accepts: the network downsamples by 32."""


def _hf_config(spec: WorkloadSpec) -> Any:  # -> transformers.PretrainedConfig
    if spec.from_models:
        return models.gpt2_config(models.MODELS[spec.name])
    if spec.family == "resnet":
        from transformers import ResNetConfig

        return ResNetConfig(**spec.config)
    # Passed through a dict: the config classes take the attention choice via **kwargs.
    kw: dict[str, Any] = {**spec.config, "use_cache": False, "attn_implementation": "eager"}
    if spec.family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(**kw)
    if spec.family == "bert":
        from transformers import BertConfig

        return BertConfig(**kw)
    from transformers import Qwen3Config

    return Qwen3Config(**kw)


def _model_class(family: Family) -> type[torch.nn.Module]:
    if family == "gpt2":
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel
    if family == "bert":
        from transformers import BertForMaskedLM

        return BertForMaskedLM
    if family == "resnet":
        from transformers import ResNetForImageClassification

        return ResNetForImageClassification
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM


def count_parameters_meta(name: str) -> int:
    """Parameter count of a workload's model, built on the "meta" device.

    No memory is allocated for the weights, so this works for the largest configs on any
    machine, and the global RNG is left untouched. Tied weights are counted once.

    Args:
        name: A key of :data:`WORKLOADS`.

    Returns:
        The number of parameter elements.

    Raises:
        ValueError: If ``name`` is unknown.

    Example:
        >>> round(count_parameters_meta("gpt2-s") / 1e6)
        124
    """
    spec = workload_spec(name)
    config = _hf_config(spec)
    cls = _model_class(spec.family)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = cls(config)
    return models.count_parameters(model)


@dataclass
class Workload:
    """A built workload: model, deterministic data and loss.

    The caller owns the optimizer and the gradient zeroing; a training step is::

        w.model.zero_grad(set_to_none=True)
        w.forward_backward(step)
        optimizer.step()

    Mixed precision: ``amp="bf16"`` or ``"fp16"`` runs the forward pass under
    ``torch.autocast``; the weights, gradients and optimizer state stay ``float32``.
    :meth:`forward_backward` applies no loss scaling, so with ``"fp16"`` small gradients
    can underflow to zero; for long fp16 runs, drive the step yourself with
    :meth:`batch`, :meth:`loss` and a ``torch.amp.GradScaler``, or use ``"bf16"``.

    Attributes:
        name: Registry key.
        family: ``"gpt2"``, ``"bert"``, ``"resnet"`` or ``"qwen3"``.
        model: The model, on ``device``, in training mode.
        n_params: Parameter elements of ``model`` (tied weights counted once).
        device: Where the model and the batches live.
        amp: ``None``, ``"bf16"`` or ``"fp16"``.
        grad_accum: Micro-batches per :meth:`forward_backward`.
        spec: The registry entry.
        seed: Seed of the initial weights.
        data_seed: Seed of the data; with the micro-batch index it fixes every batch.
        batch_size: Micro-batch size.
        seq_len: Tokens per sequence (language families), else ``None``.
        image_size: Image side in pixels (``resnet``), else ``None``.
    """

    name: str
    family: Family
    model: torch.nn.Module
    n_params: int
    device: torch.device
    amp: str | None
    grad_accum: int
    spec: WorkloadSpec = field(repr=False)
    seed: int = 0
    data_seed: int = 0
    batch_size: int = 1
    seq_len: int | None = None
    image_size: int | None = None

    def batch(self, i: int) -> tuple[torch.Tensor, ...]:
        """Micro-batch ``i``, a pure function of ``(data_seed, i)``, on :attr:`device`.

        Args:
            i: Micro-batch index (``>= 0``); step ``s`` uses ``s * grad_accum + j``.

        Returns:
            ``gpt2``/``qwen3``: ``(inputs, targets)``, ``int64`` of shape
            ``(batch_size, seq_len)``, targets shifted left by one token.
            ``bert``: ``(inputs, labels)``, same shapes; ``labels`` is ``-100`` except at
            the predicted positions. ``resnet``: ``(pixels, labels)``, ``float32`` of
            shape ``(batch_size, 3, image_size, image_size)`` and ``int64`` of shape
            ``(batch_size,)``.

        Raises:
            ValueError: If ``i`` is negative.

        Example:
            >>> inputs, targets = build_workload("gpt2-tiny").batch(0)
        """
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"batch index must be a non-negative int, got {i!r}")
        if self.family == "resnet":
            assert self.image_size is not None and self.spec.num_classes is not None
            return stripe_images(
                self.batch_size,
                self.image_size,
                self.spec.num_classes,
                self.data_seed,
                i,
                self.device,
            )
        assert self.seq_len is not None
        inputs, targets = text.batch_for(i, self.batch_size, self.seq_len, self.data_seed)
        if self.family == "bert":
            inputs, targets = masked_lm_inputs(inputs, self.data_seed, i)
        return inputs.to(self.device), targets.to(self.device)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.amp == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Scalar mean loss of :attr:`model` on ``batch`` (forward under autocast if amp).

        Args:
            batch: A batch as :meth:`batch` returns it.

        Returns:
            Next-token cross-entropy (``gpt2``, ``qwen3``), masked-token cross-entropy
            (``bert``) or classification cross-entropy (``resnet``), ``float32``.

        Example:
            >>> w = build_workload("resnet-50-tiny")
            >>> w.loss(w.batch(0)).backward()
        """
        x, y = batch
        with self._autocast():
            if self.spec.from_models:
                # The demo's own loss, so this workload matches its training job exactly.
                return models.lm_loss(self.model, x, y)
            if self.family == "resnet":
                logits = self.model(pixel_values=x).logits
            elif self.family == "bert":
                logits = self.model(input_ids=x).logits
            else:
                logits = self.model(input_ids=x, use_cache=False).logits
            # float32 logits: a bf16/fp16 log-softmax over 50k-150k classes loses the
            # precision that the small differences between logits carry.
            return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())

    def forward_backward(self, step: int) -> float:
        """Forward and backward passes of one optimizer step, accumulating into ``.grad``.

        Runs micro-batches ``step * grad_accum + j`` for ``j < grad_accum``, each loss
        scaled by ``1 / grad_accum``, so the accumulated gradient is that of the mean
        loss. Gradients are neither zeroed first nor used: that, and the optimizer step,
        are the caller's.

        Args:
            step: Optimizer step (``>= 0``).

        Returns:
            The mean unscaled loss over the micro-batches.

        Raises:
            ValueError: If ``step`` is negative.

        Example:
            >>> w = build_workload("qwen3-0.6b-tiny", grad_accum=2)
            >>> loss = w.forward_backward(0)  # micro-batches 0 and 1
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        total = torch.zeros((), device=self.device)
        for j in range(self.grad_accum):
            loss = self.loss(self.batch(step * self.grad_accum + j))
            # No division at grad_accum 1 keeps the gradients bit-identical to a plain
            # loss.backward(), as the demo's training job does it.
            (loss if self.grad_accum == 1 else loss / self.grad_accum).backward()
            total += loss.detach()
        # One host sync per step instead of one per micro-batch.
        return float(total) / self.grad_accum


def _positive(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option} must be a positive int, got {value!r}")
    return value


def build_workload(
    name: str,
    *,
    seed: int = 0,
    data_seed: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    image_size: int | None = None,
    device: str | torch.device = "cpu",
    amp: str | None = None,
    grad_accum: int = 1,
) -> Workload:
    """Build a named workload with freshly initialised weights.

    The global RNG is seeded with ``seed`` right before the model is built (on the CPU),
    so the initial weights are a function of ``seed`` alone; it is left in that stream,
    which makes the dropout masks of the first steps deterministic too. The model is
    then moved to ``device``.

    Args:
        name: A key of :data:`WORKLOADS`.
        seed: Seed of the initial weights (and of the global RNG afterwards).
        data_seed: Seed of the batches; ``seed`` if ``None``.
        batch_size: Micro-batch size; the workload's default if ``None``.
        seq_len: Tokens per sequence (language families only); default if ``None``.
        image_size: Image side in pixels (``resnet`` only, at least 32); default if
            ``None``.
        device: Device of the model and the batches.
        amp: ``None`` (float32), ``"bf16"`` or ``"fp16"`` (CUDA only): autocast for the
            forward pass; the weights stay float32 (see :class:`Workload`).
        grad_accum: Micro-batches per :meth:`Workload.forward_backward`.

    Returns:
        The :class:`Workload`, its model in training mode.

    Raises:
        ValueError: On an unknown name, a non-positive size, an option that does not
            apply to the family (``seq_len`` for images, ``image_size`` for text), a
            sequence longer than the model accepts, an unknown ``amp``, ``"fp16"`` off
            CUDA, or an unavailable CUDA device.
        TypeError: If ``seed`` or ``data_seed`` is not an int.

    Example:
        >>> w = build_workload("bert-base-tiny", seed=1, batch_size=2, amp="bf16")
        >>> w.batch(0)[0].shape
        torch.Size([2, 64])
    """
    spec = workload_spec(name)
    for option, value in (("seed", seed), ("data_seed", data_seed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{option} must be an int, got {value!r}")
    bs = spec.batch_size if batch_size is None else _positive("batch_size", batch_size)
    _positive("grad_accum", grad_accum)
    length, size = _sample_shape(spec, seq_len, image_size)
    dev = _device(device, amp)
    model = _init_model(spec, seed)
    model.to(dev)
    model.train()
    return Workload(
        name=name,
        family=spec.family,
        model=model,
        n_params=models.count_parameters(model),
        device=dev,
        amp=amp,
        grad_accum=grad_accum,
        spec=spec,
        seed=seed,
        data_seed=seed if data_seed is None else data_seed,
        batch_size=bs,
        seq_len=length,
        image_size=size,
    )


def _sample_shape(
    spec: WorkloadSpec, seq_len: int | None, image_size: int | None
) -> tuple[int | None, int | None]:
    """``(seq_len, image_size)`` of one sample, checked against the family and the model;
    the one that does not apply to the family is None."""
    name = spec.name
    if spec.family == "resnet":
        if seq_len is not None:
            raise ValueError(f"seq_len does not apply to the resnet workload {name!r}")
        size = spec.image_size if image_size is None else _positive("image_size", image_size)
        assert size is not None
        if size < _MIN_IMAGE_SIZE:
            raise ValueError(f"image_size must be at least {_MIN_IMAGE_SIZE}, got {size}")
        return None, size
    if image_size is not None:
        raise ValueError(f"image_size does not apply to the {spec.family} workload {name!r}")
    length = spec.seq_len if seq_len is None else _positive("seq_len", seq_len)
    limit = spec.max_seq_len
    assert length is not None and limit is not None
    if length > limit:
        raise ValueError(f"seq_len must be at most {limit} for {name!r}, got {length}")
    return length, None


def _device(device: str | torch.device, amp: str | None) -> torch.device:
    """The workload's device, checked to exist and to support ``amp``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if amp is not None and amp not in AMP_MODES:
        raise ValueError(f"amp must be None or one of {list(AMP_MODES)}, got {amp!r}")
    if amp == "fp16" and dev.type != "cuda":
        raise ValueError(f"amp 'fp16' needs a CUDA device, got device {str(dev)!r}")
    return dev


def _init_model(spec: WorkloadSpec, seed: int) -> torch.nn.Module:
    """The spec's model with freshly initialised weights, on the CPU; the global RNG is
    seeded with ``seed`` right before (see :func:`build_workload`)."""
    if spec.from_models:
        return models.build_model(spec.name, seed)
    config = _hf_config(spec)
    torch.manual_seed(seed)
    return _model_class(spec.family)(config)
