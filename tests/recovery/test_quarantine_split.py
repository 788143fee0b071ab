"""Resume-time quarantine splits a record file that straddles the recovered step.

Under DDP the recovered step ``s`` is the minimum over the shards, so the leading shard
often holds a record file ``first < s <= last``: its rows before ``s`` are part of the
recovered chain. The directories here are written by a real single-process
Checkpointer; ``quarantine_beyond`` is then called with the step a slower shard would
have imposed, as the distributed resume does.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowdiff
import lowdiff.recovery.quarantine as quarantine
from lowdiff.errors import CorruptCheckpointError, RecoveryWarning
from lowdiff.format import layout, sfile
from lowdiff.recovery.quarantine import quarantine_beyond, split_records
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state.capture import diff_states, snapshot_state

pytestmark = pytest.mark.multiprocess

FULL_EVERY = 4
BATCH_SIZE = 3  # records 0-2, 3-5, 6-8, 9-10; full checkpoints 0, 4, 8
STEPS = 11


def _build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def _checkpointer(model: nn.Module, opt: Any, sched: Any, d: Path) -> lowdiff.Checkpointer:
    return lowdiff.Checkpointer(
        d,
        model,
        opt,
        scheduler=sched,
        compressor=lowdiff.TopK(ratio=0.3, error_feedback=False),
        full_every=FULL_EVERY,
        records_per_file=BATCH_SIZE,
        keep_full=None,
    )


def _train(ck: lowdiff.Checkpointer, model: nn.Module, opt: Any, sched: Any, start: int, stop: int):
    snaps = {}
    for step in range(start, stop):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        ck.step()
        opt.zero_grad()
        snaps[step + 1] = snapshot_state(model, opt, sched)
    return snaps


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A directory of STEPS steps, and the state after every step."""
    d = tmp_path_factory.mktemp("split") / "ck"
    model, opt, sched = _build()
    ck = _checkpointer(model, opt, sched, d)
    assert ck.resume() == 0
    snaps = _train(ck, model, opt, sched, 0, STEPS)
    ck.close()
    return d, snaps


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lowdiff*lock"))
    return dst


def _records(d: Path) -> list[str]:
    return sorted(p.name for p in (d / layout.RECORDS_DIR).iterdir())


def _rec(first: int, last: int) -> str:
    return layout.records_path(Path("."), first, last).name


def _restored(d: Path, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt, sched = _build()
    got = lowdiff.restore(d, model, opt, sched, step=step)
    return got, snapshot_state(model, opt, sched)


@pytest.mark.parametrize("s", [5, 7])
def test_straddling_file_is_split_and_recovery_reads_it(written, tmp_path, s):
    src, snaps = written
    d = _copy(src, tmp_path / "ck")
    straddling = {5: (3, 5), 7: (6, 8)}[s]
    assert _rec(*straddling) in _records(d)
    before = sfile.read(layout.records_path(d, *straddling))

    with pytest.warns(RecoveryWarning, match="kept the records before step"):
        moved = quarantine_beyond(d, RecoveryStats(full_step=4, step=s), "run-abcdef12")

    # the rows before s stay in the chain under their own name, the rest is quarantined
    first = straddling[0]
    kept = layout.records_path(d, first, s - 1)
    assert kept.name in _records(d) and _rec(*straddling) not in _records(d)
    assert all(layout.parse_records_name(n)[1] < s for n in _records(d))  # type: ignore[index]
    assert {p.name for p in moved} >= {
        f"records--{_rec(*straddling)}",
        f"full--{layout.full_path(d, 8).name}",
    }
    assert all(p.exists() and p.parent.parent == d / layout.QUARANTINE_DIR for p in moved)

    # the split file is a complete, consistent record file: same format, same rows
    after = sfile.read(kept)
    md, old = after.metadata, before.metadata
    k = s - first
    assert (md["first_step"], md["last_step"], md["n_records"]) == (str(first), str(s - 1), str(k))
    assert md["layout_id"] == old["layout_id"] and md["run_id"] == old["run_id"]
    assert json.loads(md["records_meta"]) == json.loads(old["records_meta"])[:k]
    assert [m["step"] for m in json.loads(md["records_meta"])] == list(range(first, s))
    assert torch.equal(after.tensors["records"], before.tensors["records"][:k])

    # recovery reads it: the newest step is s, bit for bit the state trained to s
    got, state = _restored(d)
    assert got == s
    assert diff_states(snaps[s], state) == []
    # and every step before it that the kept files serve
    got, state = _restored(d, s - 1)
    assert got == s - 1 and diff_states(snaps[s - 1], state) == []


def test_training_resumed_after_a_split_continues_the_chain(written, tmp_path):
    """The records a new session writes from s on chain after the split file: every step
    it acknowledges is recoverable (moved whole, the file would take record s-1 with it)."""
    src, snaps = written
    d = _copy(src, tmp_path / "ck")
    with pytest.warns(RecoveryWarning):
        quarantine_beyond(d, RecoveryStats(full_step=4, step=5), "run-abcdef12")
    model, opt, sched = _build()
    ck = _checkpointer(model, opt, sched, d)
    assert ck.resume() == 5
    assert diff_states(snaps[5], snapshot_state(model, opt, sched)) == []
    live = _train(ck, model, opt, sched, 5, 7)  # steps 5, 6: no full checkpoint yet
    assert ck.flush() == 7
    ck.close()
    assert diff_states(snaps[7], live[7]) == []
    got, state = _restored(d)
    assert got == 7 and diff_states(snaps[7], state) == []
    assert _records(d) == [_rec(0, 2), _rec(3, 4), _rec(5, 6)]


def test_moves_are_fsynced(written, tmp_path, monkeypatch):
    src, _ = written
    d = _copy(src, tmp_path / "ck")
    synced: list[Path] = []
    monkeypatch.setattr(quarantine, "fsync_dir", synced.append)
    with pytest.warns(RecoveryWarning):
        moved = quarantine_beyond(d, RecoveryStats(full_step=4, step=5), "run-abcdef12")
    dest = moved[0].parent
    # the new entries first, then the directories the files left
    assert synced[:3] == [dest, d / layout.QUARANTINE_DIR, d]
    assert set(synced[3:]) == {d / layout.RECORDS_DIR, d / layout.FULL_DIR}


def test_a_damaged_straddling_file_is_quarantined_whole(written, tmp_path):
    src, _ = written
    d = _copy(src, tmp_path / "ck")
    p = layout.records_path(d, 3, 5)
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        split_records(p, 5)
    with pytest.warns(RecoveryWarning) as rec:
        moved = quarantine_beyond(d, RecoveryStats(full_step=4, step=5), "run-abcdef12")
    assert "kept the records" not in str(rec[0].message)
    assert f"records--{p.name}" in {q.name for q in moved}
    assert _records(d) == [_rec(0, 2)]


def test_split_refuses_a_step_that_does_not_split(written):
    src, _ = written
    p = layout.records_path(src, 3, 5)
    for step in (3, 6):
        with pytest.raises(ValueError, match="does not split"):
            split_records(p, step)


def test_only_this_shards_damaged_files_are_moved(tmp_path):
    """Under DDP every rank's recovery passes over every shard's damaged files; each rank
    moves those of its own shard only (the other ranks move theirs)."""
    job = tmp_path / "job"
    mine, other = job / "rank-00000", job / "rank-00001"
    for d in (mine, other):
        (d / layout.RECORDS_DIR).mkdir(parents=True)
        (d / layout.FULL_DIR).mkdir()
    bad_mine = mine / layout.RECORDS_DIR / _rec(0, 1)
    bad_other = other / layout.RECORDS_DIR / _rec(0, 1)
    for p in (bad_mine, bad_other):
        p.write_bytes(b"damaged")
    stats = RecoveryStats(full_step=0, step=5)  # the damaged files lie before the step
    stats.skipped = [(str(bad_mine), "checksum mismatch"), (str(bad_other), "checksum mismatch")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecoveryWarning)
        moved = quarantine_beyond(mine, stats, "run-abcdef12")
    assert [p.name for p in moved] == [f"records--{bad_mine.name}"]
    assert not bad_mine.exists() and bad_other.exists()
