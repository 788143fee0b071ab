"""``method="torch-save"``: a synchronous ``torch.save`` of the whole state.

What most training scripts do: every ``full_every`` steps, training stops while model,
optimizer, scheduler and RNG states are serialised and written. Files are
``DIR/full/ckpt-{step:012d}.pt`` with a ``.commit`` file holding their digest; the write
is atomic (temp file, fsync, rename), so a crash leaves the previous checkpoint intact.
"""

from __future__ import annotations

import time

from lowdiff.format import layout
from lowdiff_lab.baselines.base import BaselineCheckpointer
from lowdiff_lab.baselines.files import save_state

PREFIX, SUFFIX = "ckpt-", ".pt"


class TorchSaveCheckpointer(BaselineCheckpointer):
    """Synchronous full checkpoints with ``torch.save`` (see the module docstring)."""

    strategy = "torch-save"

    def _checkpoint(self, step: int) -> None:
        d = self.root / layout.FULL_DIR
        d.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        n = save_state(d / f"{PREFIX}{step:012d}{SUFFIX}", self._capture(step), step=step)
        self._stats["write_s"] += time.perf_counter() - t0
        self._stats["bytes_written"] += n
        self._durable = step
        self._retain(d, PREFIX, SUFFIX)

    def _recover(self) -> int | None:
        return self._recover_newest_file(self.root / layout.FULL_DIR, PREFIX, SUFFIX)
