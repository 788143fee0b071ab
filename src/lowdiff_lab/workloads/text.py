"""A byte-level text corpus built from the Python standard library's own source.

Every CPython installation ships its standard library as ``*.py`` files, so this gives
a few MiB of real, structured text on any machine without a download. Tokens are bytes
(vocabulary 256). The corpus is the concatenation of the files in sorted relative-path
order, read until a byte budget is reached. It is cut into blocks of
:data:`BLOCK_BYTES`, and an evenly spread ``heldout_fraction`` of the blocks (with the
default, every 20th) is held out for evaluation. Holding out the tail instead would
evaluate on whatever the alphabet puts last (with the default budget: codec tables of
``encodings/``), which is not the distribution the model trains on.

Batches are a pure function of ``(seed, step)``: each call seeds a private
:class:`torch.Generator`, so a run resumed at step ``s`` sees exactly the batches an
uninterrupted run sees from step ``s`` on, and drawing batches never disturbs the
global RNG that dropout uses (which is checkpointed training state).

Caveat: two machines with different Python versions have different standard libraries,
so the corpus (and every loss) is only reproducible for one interpreter version.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_BUDGET_BYTES = 4 * 1024 * 1024
"""Default number of corpus bytes read from the standard library."""

DEFAULT_HELDOUT_FRACTION = 0.05
"""Default fraction of the corpus blocks held out for evaluation."""

BLOCK_BYTES = 16 * 1024
"""Granularity of the train / held-out split."""

VOCAB_SIZE = 256
"""Byte-level vocabulary."""

# Third-party packages and caches live under the stdlib directory on many installs; they
# differ between environments, so they must not leak into a corpus meant to be fixed.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

# Splitmix-style odd constant: mixes seed and step into one generator seed so that
# neighbouring (seed, step) pairs do not give correlated streams.
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Corpus:
    """The loaded corpus, already split.

    Attributes:
        train: 1-D ``uint8`` tensor of training bytes (the training blocks, in order).
        heldout: 1-D ``uint8`` tensor of held-out bytes (the held-out blocks, in order).
        files: Number of source files that contributed bytes.
        root: The standard-library directory the files came from.
        heldout_blocks: Indices of the held-out :data:`BLOCK_BYTES` blocks.
    """

    train: torch.Tensor
    heldout: torch.Tensor
    files: int
    root: str
    heldout_blocks: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Total number of corpus bytes (train + held out)."""
        return int(self.train.numel() + self.heldout.numel())


_CACHE: dict[tuple[int, float], Corpus] = {}


def stdlib_dir() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[Path]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                found.append(name if rel == "." else os.path.join(rel, name))
    # Sorting the relative paths (not walk order, which is filesystem dependent) is what
    # makes the byte stream identical on every machine with the same Python.
    found.sort()
    return [root / p for p in found]


def load_corpus(
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
) -> Corpus:
    """Load (once per process and argument pair) the standard-library byte corpus.

    Args:
        budget_bytes: Stop reading once this many bytes are collected; the last file is
            truncated to fit exactly.
        heldout_fraction: Fraction of the corpus blocks held out (see
            :func:`heldout_blocks`).

    Returns:
        The cached :class:`Corpus`.

    Raises:
        ValueError: On a non-positive budget or a fraction outside ``(0, 1)``.
        RuntimeError: If the standard library yields too few bytes to split.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    key = (int(budget_bytes), float(heldout_fraction))
    cached = _CACHE.get(key)
    if cached is not None:
        return cached

    root = stdlib_dir()
    buf = bytearray()
    files = 0
    for path in _source_files(root):
        if len(buf) >= budget_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            # Broken symlinks or permission-restricted files: skipping them keeps the
            # corpus usable; the sorted order of the rest stays deterministic.
            continue
        if not data:
            continue
        buf += data[: budget_bytes - len(buf)]
        files += 1

    if len(buf) < 2 * BLOCK_BYTES:
        raise RuntimeError(
            f"the standard library at {root} yielded only {len(buf)} bytes of *.py source"
        )
    tokens = torch.frombuffer(buf, dtype=torch.uint8).clone()
    held = heldout_blocks(len(buf), heldout_fraction)
    mask = torch.zeros(len(buf), dtype=torch.bool)
    for i in held:
        mask[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES] = True
    corpus = Corpus(
        train=tokens[~mask],
        heldout=tokens[mask],
        files=files,
        root=str(root),
        heldout_blocks=held,
    )
    _CACHE[key] = corpus
    return corpus


def heldout_blocks(nbytes: int, heldout_fraction: float) -> tuple[int, ...]:
    """Indices of the held-out blocks of a corpus of ``nbytes`` bytes.

    Block ``i`` is held out when ``floor((i + 1) * f) > floor(i * f)``: an even spread of
    (up to rounding) a fraction ``f`` of the blocks, e.g. blocks 19, 39, ... for 0.05.
    At least one block is held out and at least one is kept.

    Raises:
        ValueError: If the corpus is shorter than two blocks.
    """
    n_blocks = -(-nbytes // BLOCK_BYTES)
    if n_blocks < 2:
        raise ValueError(f"a corpus of {nbytes} bytes is too short to split into blocks")
    f = heldout_fraction
    held = [i for i in range(n_blocks) if int((i + 1) * f) > int(i * f)]
    if not held:
        held = [n_blocks - 1]
    if len(held) == n_blocks:
        held = held[1:]
    return tuple(held)


def _generator_for(seed: int, step: int) -> torch.Generator:
    mixed = ((int(seed) & _MASK64) * _MIX + int(step) + 1) & _MASK64
    mixed ^= mixed >> 31
    g = torch.Generator(device="cpu")
    # manual_seed accepts at most 64 bits and must be non-negative.
    g.manual_seed(mixed & ((1 << 63) - 1))
    return g


def _windows(
    tokens: torch.Tensor, offsets: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets.unsqueeze(1) + torch.arange(seq_len + 1, dtype=torch.int64).unsqueeze(0)
    window = tokens[idx].to(torch.int64)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def batch_for(
    step: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    corpus: Corpus | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of ``step``: random windows of the training split.

    Args:
        step: Optimizer step the batch is for (0-based).
        batch_size: Number of sequences.
        seq_len: Tokens per sequence.
        seed: Data seed; together with ``step`` it fully determines the batch.
        corpus: Corpus to draw from; the default corpus if ``None``.

    Returns:
        ``(inputs, targets)``, both ``int64`` of shape ``(batch_size, seq_len)``;
        ``targets`` is ``inputs`` shifted left by one token.
    """
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    c = corpus if corpus is not None else load_corpus()
    hi = c.train.numel() - seq_len - 1
    if hi <= 0:
        raise ValueError(
            f"seq_len {seq_len} is too long for a training split of {c.train.numel()} bytes"
        )
    offsets = torch.randint(0, hi + 1, (batch_size,), generator=_generator_for(seed, step))
    return _windows(c.train, offsets, seq_len)


def eval_batches(
    n_batches: int,
    batch_size: int,
    seq_len: int,
    corpus: Corpus | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches: non-random windows spread evenly over the held-out split.

    The same arguments always give the same batches, so every run (interrupted or not)
    is evaluated on identical data.

    Args:
        n_batches: Number of batches.
        batch_size: Sequences per batch.
        seq_len: Tokens per sequence.
        corpus: Corpus to read from; the default corpus if ``None``.

    Returns:
        A list of ``(inputs, targets)`` pairs like :func:`batch_for` returns.
    """
    if n_batches <= 0 or batch_size <= 0 or seq_len <= 0:
        raise ValueError("n_batches, batch_size and seq_len must be positive")
    c = corpus if corpus is not None else load_corpus()
    hi = c.heldout.numel() - seq_len - 1
    if hi < 0:
        raise ValueError(
            f"seq_len {seq_len} is too long for a held-out split of {c.heldout.numel()} bytes"
        )
    total = n_batches * batch_size
    # Evenly spaced starts cover the whole split; overlapping windows are acceptable when
    # the split is short, distinctness is not needed for a loss estimate.
    offsets = torch.linspace(0, hi, total, dtype=torch.float64).round().to(torch.int64)
    return [
        _windows(c.heldout, offsets[i * batch_size : (i + 1) * batch_size], seq_len)
        for i in range(n_batches)
    ]
