"""Gemini's ring of ranks under DDP: each rank's checkpoint is also kept by its successor.

Rank ``r`` sends every completed in-memory checkpoint to rank ``(r + 1) % W`` and receives
rank ``r - 1``'s into two more buffers of its own holder, over a gloo group of its own
(CPU tensors, straight out of the shared buffers, apart from DDP's own traffic). At
recovery the copy travels back: rank ``r + 1`` sends what it holds of rank ``r`` to rank
``r``, whose own holder was lost with its host.

Every transfer is a header (sizes, then a JSON document: the tensors' entries and the
checkpoint's metadata) followed by the raw bytes of the buffer.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from lowdiff.ddp.context import DistContext
from lowdiff.errors import LowDiffError
from lowdiff.format.sfile import view_tensors
from lowdiff.proc import holder as rp


def _bytes_of(doc: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)


class PeerRing:
    """This rank's place in the ring, and the transfers along it.

    Args:
        ctx: this rank and the world size.
        timeout: seconds one transfer may take.
    """

    def __init__(self, ctx: DistContext, timeout: float) -> None:
        self.ctx = ctx
        self.timeout = datetime.timedelta(seconds=timeout)
        self.group: Any = None
        """The ring's own gloo group (None for a world of one: nothing travels)."""
        if ctx.world_size > 1:
            self.group = dist.new_group(backend="gloo")

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def next(self) -> int:
        """The successor, which keeps this rank's checkpoints."""
        return (self.ctx.rank + 1) % self.ctx.world_size

    @property
    def prev(self) -> int:
        """The predecessor, whose checkpoints this rank keeps."""
        return (self.ctx.rank - 1) % self.ctx.world_size

    @property
    def active(self) -> bool:
        """Whether checkpoints travel along the ring (more than one rank)."""
        return self.group is not None

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _sendrecv(
        self, out: torch.Tensor | None, into: torch.Tensor | None, dst: int, src: int
    ) -> None:
        """Send ``out`` to ``dst`` while receiving ``into`` from ``src`` (either may be None)."""
        works = []
        if out is not None:
            works.append(dist.isend(out, dst, group=self.group))
        if into is not None:
            works.append(dist.irecv(into, src, group=self.group))
        for w in works:
            if w is not None:
                w.wait(self.timeout)

    # ------------------------------------------------------------------ while training
    def exchange(
        self,
        step: int,
        blob: torch.Tensor,
        doc: dict[str, Any],
        into: torch.Tensor,
    ) -> dict[str, Any]:
        """Send this rank's checkpoint of ``step`` (``blob`` and its ``doc``: entries and
        meta) to the successor; receive the predecessor's of the same step into ``into``.

        Returns:
            The predecessor's ``doc``.
        """
        nxt, prv = self.next, self.prev
        head = _bytes_of(doc)
        sizes_in = torch.empty(3, dtype=torch.int64)
        self._sendrecv(
            torch.tensor([step, blob.numel(), head.numel()], dtype=torch.int64),
            sizes_in,
            nxt,
            prv,
        )
        p_step, p_size, p_head = (int(v) for v in sizes_in.tolist())
        if p_step != step or p_size > into.numel():
            raise LowDiffError(
                f"rank {prv} sent the checkpoint of step {p_step} ({p_size} bytes); rank "
                f"{self.rank} expected step {step} with at most {into.numel()} bytes"
            )
        head_in = torch.empty(p_head, dtype=torch.uint8)
        self._sendrecv(head, head_in, nxt, prv)
        self._sendrecv(blob, into[:p_size], nxt, prv)
        return json.loads(bytes(head_in.numpy()))

    # ------------------------------------------------------------------ at recovery
    def return_copies(
        self, send: dict[str, Any] | None, recv: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], int] | None:
        """Send the copy this rank keeps of its predecessor back to it (``send``: the copy
        as the holder's control block describes it), and receive this rank's own copy
        from the successor (``recv``).

        Returns:
            The tensors and metadata received, and their size in bytes (None: none).
        """
        shm = None
        try:
            blob = head = None
            if send is not None:
                shm = rp.attach_segment(str(send["arena"]))
                entries = rp.entries_from_json(send["entries"])
                blob = rp.segment_tensor(shm, entries[-1].end if entries else 0)
                head = _bytes_of({"entries": send["entries"], "meta": send["meta"]})
            sizes = torch.empty(2, dtype=torch.int64) if recv else None
            self._sendrecv(
                None
                if blob is None or head is None
                else torch.tensor([blob.numel(), head.numel()]),
                sizes,
                self.prev,
                self.next,
            )
            n_blob, n_head = (0, 0) if sizes is None else (int(v) for v in sizes.tolist())
            head_in = torch.empty(n_head, dtype=torch.uint8) if recv else None
            self._sendrecv(head, head_in, self.prev, self.next)
            blob_in = torch.empty(n_blob, dtype=torch.uint8) if recv else None
            self._sendrecv(blob, blob_in, self.prev, self.next)
            del blob
        finally:
            if shm is not None:
                with contextlib.suppress(Exception):
                    shm.close()
        if head_in is None or blob_in is None:
            return None
        doc = json.loads(bytes(head_in.numpy()))
        return view_tensors(rp.entries_from_json(doc["entries"]), blob_in), doc["meta"], n_blob
