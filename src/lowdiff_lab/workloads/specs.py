"""The registry of the zoo's workloads: one :class:`WorkloadSpec` per name.

Each spec is static data (family, default sizes, the ``transformers`` config of the
model); :mod:`lowdiff_lab.workloads.zoo` builds a model and its data from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from lowdiff_lab.workloads import models, text

__all__ = ["WORKLOADS", "Family", "WorkloadSpec", "workload_names", "workload_spec"]

Family = Literal["gpt2", "bert", "resnet", "qwen3"]
"""Model families of the zoo."""


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
        from_models: Built by :func:`lowdiff_lab.workloads.models.build_model` (``config``
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


def workload_spec(name: str) -> WorkloadSpec:
    """The registry entry of ``name``.

    Raises:
        ValueError: If ``name`` is not a key of :data:`WORKLOADS`.

    Example:
        >>> workload_spec("resnet-50-tiny").family
        'resnet'
    """
    spec = WORKLOADS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known: {list(WORKLOADS)}")
    return spec
