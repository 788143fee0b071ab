"""The layout of one differential record (what turns step t into step t + 1).

A record is a fixed-size byte row plus a small JSON document:

- the row holds, at offsets fixed for the whole run, every parameter's compressed
  gradient fields (``g{i}.{field}``, ``i`` = the parameter's optimizer index), the
  model's persistent buffers after the step (``buf.{name}``: BatchNorm statistics and
  the like) and the RNG states after the step (``rng.*``);
- the JSON holds the step number, the parameters that had no gradient, the per-group
  hyperparameters the optimizer used (``hp``) and those in force after the scheduler
  stepped (``hp_after``), the scheduler state after the step, and small RNG fields.

Because the row size never changes, the training process writes records straight into
pre-allocated shared-memory slots, and a batch of ``b`` records is one ``[b, row]`` tensor
in one file. The row carries no dense copy of parameters or optimizer state.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lowdiff.compressors.base import Compressor, FieldSpec
from lowdiff.format.dtypes import dtype_from_name, dtype_name
from lowdiff.format.sfile import TensorEntry, plan, view_tensors
from lowdiff.state.capture import ParamInfo, RngLayout

ROW_ALIGN = 64


@dataclass
class RecordLayout:
    """Where everything of one record lives in its row."""

    params: list[ParamInfo]
    fields: list[list[FieldSpec]]
    buffers: list[tuple[str, torch.dtype, tuple[int, ...]]]
    rng: dict[str, Any]
    entries: list[TensorEntry]
    row_bytes: int

    @classmethod
    def build(
        cls,
        params: Sequence[ParamInfo],
        compressor: Compressor,
        buffers: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        rng: RngLayout,
    ) -> RecordLayout:
        fields = []
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for p in params:
            numel = 1
            for s in p.shape:
                numel *= s
            fs = compressor.fields(numel, p.dtype)
            fields.append(fs)
            specs.extend((f"g{p.index}.{f.name}", f.dtype, (f.numel,)) for f in fs)
        specs.extend((f"buf.{n}", dt, shape) for n, dt, shape in buffers)
        specs.extend(rng.specs())
        entries, size = plan(specs)
        row = -(-size // ROW_ALIGN) * ROW_ALIGN if size else ROW_ALIGN
        return cls(list(params), fields, list(buffers), rng.to_dict(), entries, row)

    # -- serialisation into the manifest ------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "row_bytes": self.row_bytes,
            "params": [[p.index, p.name, list(p.shape), dtype_name(p.dtype)] for p in self.params],
            "fields": [[[f.name, dtype_name(f.dtype), f.numel] for f in fs] for fs in self.fields],
            "buffers": [[n, dtype_name(dt), list(shape)] for n, dt, shape in self.buffers],
            "rng": self.rng,
            "entries": [
                [e.name, dtype_name(e.dtype), list(e.shape), e.start, e.end] for e in self.entries
            ],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RecordLayout:
        params = [
            ParamInfo(int(i), str(n), tuple(int(s) for s in shape), dtype_from_name(dt))
            for i, n, shape, dt in d["params"]
        ]
        fields = [
            [FieldSpec(str(n), dtype_from_name(dt), int(k)) for n, dt, k in fs]
            for fs in d["fields"]
        ]
        buffers = [
            (str(n), dtype_from_name(dt), tuple(int(s) for s in shape))
            for n, dt, shape in d["buffers"]
        ]
        entries = [
            TensorEntry(str(n), dtype_from_name(dt), tuple(int(s) for s in shape), int(a), int(b))
            for n, dt, shape, a, b in d["entries"]
        ]
        return cls(params, fields, buffers, dict(d["rng"]), entries, int(d["row_bytes"]))

    @property
    def layout_id(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    # -- access ---------------------------------------------------------------------------
    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into one row (a 1-D ``uint8`` tensor of ``row_bytes``)."""
        return view_tensors(self.entries, row)

    def payload(self, views: Mapping[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """The compressed fields of the k-th parameter (in optimizer order)."""
        idx = self.params[k].index
        return {f.name: views[f"g{idx}.{f.name}"] for f in self.fields[k]}

    def buffer_values(self, views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: views[f"buf.{n}"] for n, _, _ in self.buffers}

    def rng_tensors(self, views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in views.items() if k.startswith("rng.")}
