"""Small GPT-2-style byte-level language models, built from configs (no download).

Every model uses ``transformers``' GPT-2 with the "eager" attention implementation:
it is plain matmul + softmax, bit-reproducible across processes on CPU for a fixed
thread count, whereas the fused SDPA kernels may pick different algorithms per call.
Dropout stays on (0.1) so the global RNG is part of the training state that
checkpointing has to restore exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lowdiff_lab.workloads.text import VOCAB_SIZE


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one named model.

    Attributes:
        n_layer: Transformer blocks.
        n_embd: Hidden width.
        n_head: Attention heads.
        n_positions: Longest sequence the model accepts.
        dropout: Residual and embedding dropout probability.
        attn_dropout: Attention-probability dropout. Off by default: on CPU, drawing a
            mask over every (head, query, key) triple is a large share of the step time
            (see docs/workloads.md), and residual dropout alone already makes the RNG
            state matter.
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int = 128
    dropout: float = 0.1
    attn_dropout: float = 0.0


MODELS: dict[str, ModelSpec] = {
    # The demo default: ~0.84 M parameters, small enough for the demo's four training runs
    # on two CPU cores (its step time is in docs/workloads.md).
    "gpt2-demo": ModelSpec(n_layer=4, n_embd=128, n_head=4, n_positions=128),
    # The hot-path benchmark's end-to-end model (``lowdiff bench hotpaths``): ~3.3 M
    # parameters, batch 8 x 128.
    "gpt2-3m": ModelSpec(n_layer=4, n_embd=256, n_head=4, n_positions=128),
    # Tests: ~0.12 M parameters, a step dominated by per-op overhead (docs/workloads.md).
    "gpt2-tiny": ModelSpec(n_layer=2, n_embd=64, n_head=4, n_positions=128),
}
"""Named model sizes; add entries here to make them available by name everywhere."""


def gpt2_config(spec: ModelSpec) -> Any:  # -> transformers.GPT2Config (import kept lazy)
    """The ``transformers`` GPT-2 config of ``spec``: byte vocabulary, eager attention."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=spec.n_positions,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        resid_pdrop=spec.dropout,
        embd_pdrop=spec.dropout,
        attn_pdrop=spec.attn_dropout,
        # GPT-2's default special ids (50256) lie outside a byte vocabulary.
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation="eager",  # type: ignore[call-arg]  # accepted via **kwargs
    )


def build_model(name: str, seed: int) -> torch.nn.Module:
    """Build a freshly initialised named model.

    Args:
        name: A key of :data:`MODELS`.
        seed: Seeds the global RNG right before construction, so the initial weights are
            a function of ``seed`` alone. The global RNG is left in that seeded stream,
            which makes the dropout masks of the first steps deterministic too.

    Returns:
        A ``GPT2LMHeadModel`` in training mode.

    Raises:
        ValueError: If ``name`` is unknown.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    from transformers import GPT2LMHeadModel

    config = gpt2_config(MODELS[name])
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.train()
    return model


def model_spec(name: str) -> dict[str, float | int]:
    """The named model's shape as a plain dict (for reports)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return asdict(MODELS[name])


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on one batch.

    The targets are already shifted (see :func:`lowdiff_lab.workloads.text.batch_for`), so
    the loss is computed here instead of through the model's ``labels`` argument, which
    would shift a second time.

    Args:
        model: A model from :func:`build_model`.
        inputs: ``int64`` token ids, shape ``(batch, seq)``.
        targets: ``int64`` next-token ids, same shape.

    Returns:
        A scalar loss tensor.
    """
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
