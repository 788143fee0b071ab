"""The generated batches of the zoo's BERT and ResNet workloads, pure functions of their seeds.

- :func:`masked_lm_inputs`: the masked-LM inputs and labels of a byte batch: exactly
  :data:`MASK_FRACTION` of the positions of every sequence are chosen, and of those 80%
  become :data:`MASK_ID`, 10% a random byte and 10% stay;
- :func:`stripe_images`: images of oriented stripe patterns, one class per pattern.

Every random draw comes from a generator seeded from ``(seed, batch index, stream)``, so
batch ``i`` is the same whichever batches were drawn before it.
"""

from __future__ import annotations

import math

import torch

from lowdiff_lab.workloads import text

__all__ = ["MASK_FRACTION", "MASK_ID", "masked_lm_inputs", "stripe_images"]

MASK_ID = text.VOCAB_SIZE
"""The [MASK] token of the BERT workloads: the first id above the byte range."""

MASK_FRACTION = 0.15
"""Fraction of the positions of each sequence that the BERT workloads predict."""

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


def masked_lm_inputs(ids: torch.Tensor, seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` of the masked-LM task on the byte batch ``ids`` (batch ``index``
    of data seed ``seed``); ``labels`` is ``-100`` except at the predicted positions."""
    g = _generator(seed, index, _STREAM_MASK)
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


def stripe_images(
    batch_size: int,
    image_size: int,
    num_classes: int,
    seed: int,
    index: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixels, labels)`` of image batch ``index`` of data seed ``seed``, on ``device``."""
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
