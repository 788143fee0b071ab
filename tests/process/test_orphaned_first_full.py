"""A trainer that dies before its checkpointing process took the state it staged for the
session's first full checkpoint: the records after it are never published, so the
directory holds nothing but its manifest and the next trainer starts afresh (records
without the full checkpoint they chain from could never be recovered, and every later
resume() would fail)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from lowdiff.engine.wire.configs import WriterConfig
from lowdiff.engine.wire.messages import Full, Record
from lowdiff.engine.writer.writer import Writer
from lowdiff.format import layout
from lowdiff.proc import channel
from lowdiff.proc.child_end import ChildEnd
from lowdiff.recovery.directory import is_empty_dir


def _writer(root: Path) -> Writer:
    for sub in (layout.FULL_DIR, layout.RECORDS_DIR):
        (root / sub).mkdir(parents=True)
    cfg = WriterConfig(str(root), batch_size=2, keep_full=2, row_bytes=8, layout_id="x", run_id="r")
    requests, results = multiprocessing.Pipe(duplex=False)
    slots = torch.zeros((4, 8), dtype=torch.uint8)
    return Writer(
        cfg, slots, channel.Counters(channel.new_counters()), ChildEnd(requests, results)
    )


def test_records_wait_for_a_first_full_checkpoint_that_never_comes(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    # the staging buffer's Stage could not be rebuilt (its owner is dead): the full
    # checkpoint of step 0 fails, and the drain goes on with the records
    assert w.handle_orphaned(Full(0, [["t", "uint8", [8], 0, 8]], {"step": "0"}))
    assert w.full.persisted < 0 and w.full.error is None
    assert w.handle_orphaned(Record(0, 0, "{}"))
    with pytest.raises(RuntimeError, match=r"records 0\.\.1 were not written.*first full"):
        w.handle_orphaned(Record(1, 1, "{}"))
    assert list((tmp_path / layout.RECORDS_DIR).iterdir()) == []
    assert list((tmp_path / layout.FULL_DIR).iterdir()) == []
    # nothing durable: to a new trainer the directory is one to start afresh in
    assert is_empty_dir(tmp_path)
