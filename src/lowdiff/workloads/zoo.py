"""A model zoo of benchmark workloads: GPT-2, BERT, ResNet and Qwen3, built from configs.

Every workload is a model plus its data and loss, behind one small object
(:class:`Workload`), so the benchmark can sweep the checkpointing strategies over
models of very different shapes without knowing any of them:

>>> w = build_workload("gpt2-s-tiny", seed=0)
>>> w.model.zero_grad(set_to_none=True)
>>> loss = w.forward_backward(step=0)  # grads are now in w.model's .grad fields

Families and their objectives:

- ``gpt2``: ``GPT2LMHeadModel``, next-byte prediction on the standard-library byte
  corpus of :mod:`lowdiff.workloads.text`. ``gpt2-demo``, ``gpt2-tiny`` and ``gpt2-3m``
  are the models of :mod:`lowdiff.workloads.models`, built by its ``build_model`` and scored by
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
bit-reproducible on CPU for a fixed thread count (see :mod:`lowdiff.workloads.models`).
Weights are always initialised on the CPU from the global RNG seeded with ``seed`` and
then moved to the target device, so a workload starts from the same weights on every
device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch
import torch.nn.functional as F

from lowdiff.workloads import models, text

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

Family = Literal["gpt2", "bert", "resnet", "qwen3"]
"""Model families of the zoo."""

AMP_MODES = ("bf16", "fp16")
"""Accepted values of ``amp`` besides ``None``."""

MASK_ID = text.VOCAB_SIZE
"""The [MASK] token of the BERT workloads: the first id above the byte range."""

MASK_FRACTION = 0.15
"""Fraction of the positions of each sequence that the BERT workloads predict."""

_MIN_IMAGE_SIZE = 32
"""Smallest image side a ResNet workload accepts: the network downsamples by 32."""


@dataclass(frozen=True)
class WorkloadSpec:
    """Static description of one named workload.

    Attributes:
        name: Registry key.
        family: Model family, which fixes the model class, the data and the loss.
        tiny: Whether the workload is CPU-sized (a step in well under a second on one core).
        batch_size: Default micro-batch size.
        seq_len: Default tokens per sequence (language families), else ``None``.
        image_size: Default image side in pixels (``resnet``), else ``None``.
        config: Keyword arguments of the family's ``transformers`` config class.
        published_params: Parameter count of the published model this one reproduces
            (tied weights counted once), for reports; ``None`` for the tiny variants.
        from_models: Built by :func:`lowdiff.workloads.models.build_model` (``config``
            unused) rather than from ``config``.
    """

    name: str
    family: Family
    tiny: bool
    batch_size: int
    seq_len: int | None = None
    image_size: int | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    published_params: int | None = None
    from_models: bool = False

    @property
    def max_seq_len(self) -> int | None:
        """Longest sequence the model accepts (``None`` for images)."""
        if self.from_models:
            return models.MODELS[self.name].n_positions
        if self.family == "gpt2":
            return int(self.config["n_positions"])
        if self.family in ("bert", "qwen3"):
            return int(self.config["max_position_embeddings"])
        return None

    @property
    def num_classes(self) -> int | None:
        """Number of image classes (``resnet``), else ``None``."""
        return int(self.config["num_labels"]) if self.family == "resnet" else None


def _gpt2(name: str, n_layer: int, n_embd: int, n_head: int, **kw: Any) -> WorkloadSpec:
    tiny = name.endswith("-tiny")
    config = {
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        # The tiny models keep only the byte range; the full ones keep GPT-2's BPE
        # vocabulary so that their size is the published one.
        "vocab_size": text.VOCAB_SIZE if tiny else 50257,
        "n_positions": 128 if tiny else 1024,
    }
    if tiny:
        # GPT-2's default special ids (50256) lie outside a byte vocabulary.
        config.update(bos_token_id=0, eos_token_id=0)
    return WorkloadSpec(name, "gpt2", tiny, config=MappingProxyType(config), **kw)


def _bert(
    name: str, layers: int, hidden: int, heads: int, intermediate: int, **kw: Any
) -> WorkloadSpec:
    tiny = name.endswith("-tiny")
    config = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        # 512 leaves room for MASK_ID (256) above the bytes.
        "vocab_size": 512 if tiny else 30522,
        "max_position_embeddings": 128 if tiny else 512,
    }
    return WorkloadSpec(name, "bert", tiny, config=MappingProxyType(config), **kw)


def _resnet(
    name: str,
    depths: tuple[int, ...],
    hidden_sizes: tuple[int, ...],
    embedding_size: int,
    num_labels: int,
    **kw: Any,
) -> WorkloadSpec:
    config = {
        "depths": list(depths),
        "hidden_sizes": list(hidden_sizes),
        "embedding_size": embedding_size,
        "layer_type": "bottleneck",
        "num_labels": num_labels,
    }
    return WorkloadSpec(
        name, "resnet", name.endswith("-tiny"), config=MappingProxyType(config), **kw
    )


def _qwen3(
    name: str,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    **kw: Any,
) -> WorkloadSpec:
    tiny = name.endswith("-tiny")
    config = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": text.VOCAB_SIZE if tiny else 151936,
        "max_position_embeddings": 128 if tiny else 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "rms_norm_eps": 1e-6,
        # The published 0.6B, 1.7B and 4B checkpoints all tie the LM head to the embedding.
        "tie_word_embeddings": True,
    }
    return WorkloadSpec(name, "qwen3", tiny, config=MappingProxyType(config), **kw)


# The tiny variants keep each family's block types and the ratios between its sizes: the
# transformers get 1/6 (GPT-2, BERT) or 1/9 (Qwen3) of the depth, 1/16 of the width and
# 1/4 of the heads; the ResNets keep their four bottleneck stages, at 1/8 of the width
# with one block per stage (four in the third, the deep one, of resnet-101-tiny).
_SPECS: tuple[WorkloadSpec, ...] = (
    WorkloadSpec("gpt2-demo", "gpt2", True, batch_size=8, seq_len=128, from_models=True),
    WorkloadSpec("gpt2-tiny", "gpt2", True, batch_size=4, seq_len=64, from_models=True),
    WorkloadSpec("gpt2-3m", "gpt2", True, batch_size=8, seq_len=128, from_models=True),
    _gpt2("gpt2-s", 12, 768, 12, batch_size=8, seq_len=512, published_params=124_000_000),
    _gpt2("gpt2-m", 24, 1024, 16, batch_size=8, seq_len=512, published_params=355_000_000),
    _gpt2("gpt2-l", 36, 1280, 20, batch_size=4, seq_len=512, published_params=774_000_000),
    _gpt2("gpt2-s-tiny", 2, 48, 3, batch_size=4, seq_len=64),
    _gpt2("gpt2-m-tiny", 4, 64, 4, batch_size=4, seq_len=64),
    _gpt2("gpt2-l-tiny", 6, 80, 5, batch_size=4, seq_len=64),
    _bert("bert-base", 12, 768, 12, 3072, batch_size=32, seq_len=128, published_params=110_000_000),
    _bert(
        "bert-large", 24, 1024, 16, 4096, batch_size=16, seq_len=128, published_params=335_000_000
    ),
    _bert("bert-base-tiny", 2, 48, 3, 192, batch_size=4, seq_len=64),
    _bert("bert-large-tiny", 4, 64, 4, 256, batch_size=4, seq_len=64),
    _resnet(
        "resnet-50",
        depths=(3, 4, 6, 3),
        hidden_sizes=(256, 512, 1024, 2048),
        embedding_size=64,
        num_labels=1000,
        batch_size=32,
        image_size=224,
        published_params=25_600_000,
    ),
    _resnet(
        "resnet-101",
        depths=(3, 4, 23, 3),
        hidden_sizes=(256, 512, 1024, 2048),
        embedding_size=64,
        num_labels=1000,
        batch_size=32,
        image_size=224,
        published_params=44_500_000,
    ),
    _resnet(
        "resnet-50-tiny",
        depths=(1, 1, 1, 1),
        hidden_sizes=(32, 64, 128, 256),
        embedding_size=8,
        num_labels=10,
        batch_size=16,
        image_size=32,
    ),
    _resnet(
        "resnet-101-tiny",
        depths=(1, 1, 4, 1),
        hidden_sizes=(32, 64, 128, 256),
        embedding_size=8,
        num_labels=10,
        batch_size=16,
        image_size=32,
    ),
    _qwen3(
        "qwen3-0.6b",
        layers=28,
        hidden=1024,
        intermediate=3072,
        heads=16,
        kv_heads=8,
        head_dim=128,
        batch_size=4,
        seq_len=512,
        published_params=600_000_000,
    ),
    _qwen3(
        "qwen3-1.7b",
        layers=28,
        hidden=2048,
        intermediate=6144,
        heads=16,
        kv_heads=8,
        head_dim=128,
        batch_size=2,
        seq_len=512,
        published_params=1_700_000_000,
    ),
    _qwen3(
        "qwen3-4b",
        layers=36,
        hidden=2560,
        intermediate=9728,
        heads=32,
        kv_heads=8,
        head_dim=128,
        batch_size=1,
        seq_len=512,
        published_params=4_000_000_000,
    ),
    _qwen3("qwen3-0.6b-tiny", 3, 64, 192, 4, 2, 32, batch_size=4, seq_len=64),
    _qwen3("qwen3-1.7b-tiny", 3, 128, 384, 4, 2, 32, batch_size=4, seq_len=64),
    _qwen3("qwen3-4b-tiny", 4, 160, 608, 8, 2, 32, batch_size=4, seq_len=64),
)

WORKLOADS: dict[str, WorkloadSpec] = {s.name: s for s in _SPECS}
"""Every workload, by name, in a fixed order (families grouped, full before tiny)."""


def workload_names(*, tiny: bool | None = None) -> list[str]:
    """Names of the registered workloads, in registry order.

    Args:
        tiny: ``True`` for the CPU-sized ones only (the ``-tiny`` variants, ``gpt2-demo``,
            ``gpt2-tiny`` and ``gpt2-3m``), ``False`` for the full-size ones only, ``None`` for all.

    Example:
        >>> workload_names(tiny=False)[:3]
        ['gpt2-s', 'gpt2-m', 'gpt2-l']
    """
    return [n for n, s in WORKLOADS.items() if tiny is None or s.tiny == tiny]


def _spec(name: str) -> WorkloadSpec:
    spec = WORKLOADS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known: {list(WORKLOADS)}")
    return spec


def _hf_config(spec: WorkloadSpec) -> Any:  # -> transformers.PretrainedConfig
    if spec.from_models:
        return models._config(models.MODELS[spec.name])
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
    spec = _spec(name)
    config = _hf_config(spec)
    cls = _model_class(spec.family)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = cls(config)
    return models.count_parameters(model)


# Splitmix64 finaliser: turns (seed, index, stream) into well-spread generator seeds, so
# neighbouring indices and the different random streams of one batch are uncorrelated.
_M64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _generator(
    seed: int, index: int, stream: int, device: torch.device | None = None
) -> torch.Generator:
    mixed = _splitmix(_splitmix(_splitmix(stream) ^ (seed & _M64)) ^ (index & _M64))
    g = torch.Generator(device=device if device is not None else "cpu")
    g.manual_seed(mixed & ((1 << 63) - 1))  # manual_seed takes at most 63 bits
    return g


# Streams of _generator, one per independent use.
_STREAM_MASK = 1
_STREAM_IMAGE = 2
_STREAM_NOISE = 3
_STREAM_CLASSES = 4


def _mask_tokens(ids: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    b, n = ids.shape
    n_mask = max(1, round(MASK_FRACTION * n))
    # A fixed count per sequence (the first n_mask of a random permutation) rather than a
    # coin per position: every micro-batch then averages over the same number of targets.
    order = torch.rand(b, n, generator=g).argsort(dim=1, stable=True)
    chosen = torch.zeros(b, n, dtype=torch.bool)
    chosen.scatter_(1, order[:, :n_mask], True)
    action = torch.rand(b, n, generator=g)
    random_ids = torch.randint(0, text.VOCAB_SIZE, (b, n), generator=g)
    inputs = ids.clone()
    to_mask = chosen & (action < 0.8)
    to_random = chosen & (action >= 0.8) & (action < 0.9)
    inputs[to_mask] = MASK_ID
    inputs[to_random] = random_ids[to_random]
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return inputs, labels


def _class_table(num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Fixed for every data seed: the classes are the task, the data seed only picks samples.
    g = _generator(0, num_classes, _STREAM_CLASSES)
    # Evenly spread orientations (shuffled against the other attributes) keep the 10
    # classes of a tiny workload well apart; tint and frequency separate them further.
    angle = math.pi * torch.randperm(num_classes, generator=g).double() / num_classes
    freq = 2.0 + 4.0 * torch.rand(num_classes, generator=g, dtype=torch.float64)
    tint = torch.rand(num_classes, 3, generator=g, dtype=torch.float64) * 2.0 - 1.0
    return angle, freq, tint


def _images(
    batch_size: int,
    image_size: int,
    num_classes: int,
    seed: int,
    index: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    g = _generator(seed, index, _STREAM_IMAGE)
    labels = torch.randint(0, num_classes, (batch_size,), generator=g)
    phase = 2.0 * math.pi * torch.rand(batch_size, generator=g, dtype=torch.float64)
    contrast = 0.5 + torch.rand(batch_size, generator=g, dtype=torch.float64)
    angle, freq, tint = _class_table(num_classes)
    a, f, t = angle[labels], freq[labels], tint[labels]
    # The per-sample parameters are tiny and drawn on the CPU (identical on every device);
    # the pixels are computed on the target device, so a 224 x 224 batch costs no host
    # time on a GPU.
    coords = torch.arange(image_size, dtype=torch.float32, device=device) / image_size
    y, x = coords.view(-1, 1), coords.view(1, -1)
    cos = torch.cos(a).float().to(device).view(-1, 1, 1)
    sin = torch.sin(a).float().to(device).view(-1, 1, 1)
    f_ = f.float().to(device).view(-1, 1, 1)
    ph = phase.float().to(device).view(-1, 1, 1)
    stripes = torch.sin(2.0 * math.pi * f_ * (x * cos + y * sin) + ph)  # (b, h, w)
    # A tinted stripe pattern on a tinted background: the tint is learnable from the mean
    # colour, the orientation and frequency only from the spatial structure.
    c = contrast.float().to(device).view(-1, 1, 1, 1)
    tint_ = t.float().to(device).view(-1, 3, 1, 1)
    pixels = tint_ * (0.5 + 0.5 * c * stripes.unsqueeze(1))
    # The noise is the one large draw; a generator on the target device keeps it there. It
    # is reproducible per device type (CPU and CUDA generators give different streams).
    noise = torch.randn(
        pixels.shape, generator=_generator(seed, index, _STREAM_NOISE, device), device=device
    )
    return pixels + 0.5 * noise, labels.to(device)


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
            return _images(
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
            inputs, targets = _mask_tokens(inputs, _generator(self.data_seed, i, _STREAM_MASK))
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
    spec = _spec(name)
    for option, value in (("seed", seed), ("data_seed", data_seed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{option} must be an int, got {value!r}")
    bs = spec.batch_size if batch_size is None else _positive("batch_size", batch_size)
    _positive("grad_accum", grad_accum)

    if spec.family == "resnet":
        if seq_len is not None:
            raise ValueError(f"seq_len does not apply to the resnet workload {name!r}")
        size = spec.image_size if image_size is None else _positive("image_size", image_size)
        assert size is not None
        if size < _MIN_IMAGE_SIZE:
            raise ValueError(f"image_size must be at least {_MIN_IMAGE_SIZE}, got {size}")
        length = None
    else:
        if image_size is not None:
            raise ValueError(f"image_size does not apply to the {spec.family} workload {name!r}")
        length = spec.seq_len if seq_len is None else _positive("seq_len", seq_len)
        limit = spec.max_seq_len
        assert length is not None and limit is not None
        if length > limit:
            raise ValueError(f"seq_len must be at most {limit} for {name!r}, got {length}")
        size = None

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

    if spec.from_models:
        model = models.build_model(name, seed)
    else:
        config = _hf_config(spec)
        torch.manual_seed(seed)
        model = _model_class(spec.family)(config)
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
