"""The manifest entry that lets an ``hf`` export rebuild a ``transformers`` model.

A checkpoint normally holds only tensors and the optimizer's class; to write a
``save_pretrained`` directory without the training code, the exporter also needs the
model's architecture. The engine records it once, in the manifest, when it creates a
checkpoint directory (:func:`model_config_entry`), and :mod:`lowdiff.exporting` reads it
back under :data:`MODEL_CONFIG_KEY`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from lowdiff.state.capture import unwrap_model

__all__ = ["MODEL_CONFIG_KEY", "model_config_entry"]

MODEL_CONFIG_KEY = "model_config"
"""Manifest entry with a ``transformers`` model's class and config (for ``format="hf"``)."""


def model_config_entry(model: torch.nn.Module) -> dict[str, Any]:
    """``{"model_config": ...}`` for a ``transformers`` model, else ``{}`` (a manifest entry).

    The entry holds the model's class name and its config as plain JSON (``to_dict()``),
    enough to rebuild the architecture for an ``hf`` export; nothing is pickled. Only a
    model of a class ``transformers`` itself exports is recorded, and ``transformers`` is
    never imported here (a model of it means it is loaded already).

    Example:
        >>> model_config_entry(torch.nn.Linear(2, 2))
        {}
    """
    tf = sys.modules.get("transformers")
    m = unwrap_model(model)
    if tf is None or not isinstance(m, getattr(tf, "PreTrainedModel", ())):
        return {}
    cls = type(m).__name__
    if getattr(tf, cls, None) is not type(m):
        return {}
    try:
        config = json.loads(getattr(m, "config").to_json_string(use_diff=False))  # noqa: B009
        json.dumps(config, allow_nan=False)  # the manifest is strict JSON
    except (TypeError, ValueError, AttributeError):
        return {}
    return {MODEL_CONFIG_KEY: {"library": "transformers", "class": cls, "config": config}}
