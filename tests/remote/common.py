"""What the remote tier's training tests share: an extra state and the state they compare."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowdiff.state.capture import snapshot_state


class Counter:
    """Extra state: a position and a tensor (what a data loader checkpoints)."""

    def __init__(self) -> None:
        self.pos = 0
        self.seen = torch.zeros(3, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "seen": self.seen.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos, self.seen = int(sd["pos"]), sd["seen"].clone()


def train_state(m: nn.Module, o: Any, s: Any, c: Counter) -> dict[str, torch.Tensor]:
    """Model, optimizer, scheduler, RNG and the counter, as tensors to compare."""
    out = snapshot_state(m, o, s)
    out["extra.pos"] = torch.tensor(c.pos)
    out["extra.seen"] = c.seen.clone()
    return out
