"""Records of two trajectories never mix: lineage in the files, checked by recovery.

The condition: run A trains to step 10; its files past step 6 disappear (recovery at 6
quarantines them), run B resumes at 6 and trains to 10 on other data; then A's files
come back (a power loss undoes a quarantine move that was not durable). Without lineage
recovery would replay A's records on B's state (or B's on A's): a wrong state that no
checksum can see.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.errors import RecoveryWarning
from lowdiff.format import layout, sfile
from lowdiff.recovery.scan import FileInfo, Scan, make_plan, recoverable_intervals, scan
from lowdiff.recovery.shards import plan_sharded
from lowdiff.state.capture import diff_states, snapshot_state, state_tensors

pytestmark = pytest.mark.multiprocess

TOTAL = 10
RESUME_AT = 6
FULL_EVERY = 4


def _build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(
    ck: lowdiff.Checkpointer, model: nn.Module, opt: Any, start: int, stop: int, data: int
) -> dict[int, dict[str, torch.Tensor]]:
    """Train steps ``start .. stop-1`` on data stream ``data``; the state after each step."""
    snaps = {}
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * data + step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        ck.step()
        opt.zero_grad()
        snaps[step + 1] = snapshot_state(model, opt)
    return snaps


def _checkpointer(model: nn.Module, opt: Any, root: Path, batch_size: int) -> lowdiff.Checkpointer:
    return lowdiff.Checkpointer(
        root,
        model,
        opt,
        compressor=lowdiff.TopK(ratio=0.25, error_feedback=False),
        full_every=FULL_EVERY,
        records_per_file=batch_size,
        keep_full=None,
    )


def _meta(p: Path) -> dict[str, str]:
    return sfile.read_header(p).metadata


def _row(p: Path, step: int) -> torch.Tensor:
    first, _ = layout.parse_records_name(p.name)  # type: ignore[misc]
    return sfile.read(p).tensors["records"][step - first]


def _equal(want: dict[str, torch.Tensor], model: nn.Module, opt: Any) -> bool:
    got = state_tensors(model, opt)
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _restore(root: Path, step: int | None = None) -> tuple[int, nn.Module, Any, list[str]]:
    model, opt = _build(seed=99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = lowdiff.restore(root, model, opt, step=step)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RecoveryWarning)]
    return got, model, opt, msgs


def _two_runs(root: Path, aside: Path, b_batch: int) -> dict[str, Any]:
    """Run A to TOTAL (batch 2), set aside its files past RESUME_AT, resume B there (batch
    ``b_batch``, other data) and train it to TOTAL. A's files stay in ``aside``."""
    model, opt = _build()
    ck = _checkpointer(model, opt, root, batch_size=2)
    assert ck.resume() == 0
    a_snaps = _train(ck, model, opt, 0, TOTAL, data=1)
    ck.close()
    a_run = _meta(layout.full_path(root, 0))["run_id"]

    aside.mkdir()
    moved = [
        p
        for p in sorted((root / layout.RECORDS_DIR).iterdir())
        if layout.parse_records_name(p.name)[0] >= RESUME_AT  # type: ignore[index]
    ] + [layout.full_path(root, 8)]
    assert [p.name for p in moved] == [
        layout.records_path(root, 6, 7).name,
        layout.records_path(root, 8, 9).name,
        layout.full_path(root, 8).name,
    ]
    for p in moved:
        shutil.copy2(p, aside / p.name)
        p.unlink()

    model, opt = _build(seed=5)
    ck = _checkpointer(model, opt, root, batch_size=b_batch)
    assert ck.resume() == RESUME_AT
    assert ck.recovery_stats is not None
    # the state came from A's record file [4, 5]
    assert ck.recovery_stats.state_run_id == a_run
    assert not diff_states(a_snaps[RESUME_AT], state_tensors(model, opt))
    b_snaps = _train(ck, model, opt, RESUME_AT, TOTAL, data=2)
    ck.close()
    b_run = _meta(layout.full_path(root, 8))["run_id"]
    assert b_run != a_run
    # the two trajectories differ from step 7 on: mixing them would be visible
    assert diff_states(a_snaps[TOTAL], b_snaps[TOTAL])
    return {"a_run": a_run, "b_run": b_run, "a": a_snaps, "b": b_snaps}


def test_record_files_name_the_run_they_follow(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    r = _two_runs(root, tmp_path / "aside", b_batch=3)
    rec = root / layout.RECORDS_DIR
    follows = {p.name: (_meta(p)["run_id"], _meta(p).get("follows")) for p in rec.iterdir()}
    a, b = r["a_run"], r["b_run"]
    name = layout.records_path
    assert follows == {
        # a fresh session follows its own step-0 full checkpoint
        name(root, 0, 1).name: (a, a),
        name(root, 2, 3).name: (a, a),
        name(root, 4, 5).name: (a, a),
        # B's first record follows the state it resumed from (A's), then B's own
        name(root, 6, 8).name: (b, a),
        name(root, 9, 9).name: (b, b),
    }
    got, model, opt, msgs = _restore(root)
    assert (got, msgs) == (TOTAL, [])
    assert _equal(r["b"][TOTAL], model, opt)


def test_old_records_are_not_replayed_on_the_resumed_state(tmp_path: Path) -> None:
    root, aside = tmp_path / "ckpt", tmp_path / "aside"
    r = _two_runs(root, aside, b_batch=3)
    rec = root / layout.RECORDS_DIR
    a_89, b_99 = layout.records_path(root, 8, 9), layout.records_path(root, 9, 9)
    # the power loss: A's record files reappear beside B's ([6, 8], [9, 9])
    for n in ("6-7", "8-9"):
        first, last = map(int, n.split("-"))
        shutil.copy2(aside / layout.records_path(root, first, last).name, rec)
    assert _meta(a_89)["run_id"] == r["a_run"]
    # the condition: at step 9 the chain finds A's [8, 9] before B's [9, 9], and A's
    # record of step 9 is not B's
    sc = scan(root)
    at9 = sorted(
        (f for f in sc.records if f.first_step <= 9 <= f.last_step),
        key=lambda f: (f.first_step, -f.last_step),
    )
    assert [f.path.name for f in at9] == [a_89.name, b_99.name]
    assert not torch.equal(_row(a_89, 9), _row(b_99, 9))

    got, model, opt, msgs = _restore(root)
    assert got == TOTAL
    assert _equal(r["b"][TOTAL], model, opt)
    assert len(msgs) == 1
    assert a_89.name in msgs[0] and r["a_run"] in msgs[0] and r["b_run"] in msgs[0]
    r["b"][RESUME_AT] = r["a"][RESUME_AT]
    for s in range(RESUME_AT, TOTAL + 1):
        got, model, opt, _ = _restore(root, step=s)
        assert got == s
        assert _equal(r["b"][s], model, opt), f"step {s}"

    info = lowdiff.inspect_dir(root)
    assert info.recoverable_intervals == [(0, TOTAL)]
    assert [p.name for p, _ in info.foreign] == [a_89.name]

    # a resume moves A's file out of the chain and goes on from B's state
    model, opt = _build(seed=7)
    ck = _checkpointer(model, opt, root, batch_size=3)
    with pytest.warns(RecoveryWarning, match=a_89.name):
        assert ck.resume() == TOTAL
    assert ck.recovery_stats is not None and ck.recovery_stats.state_run_id == r["b_run"]
    assert _equal(r["b"][TOTAL], model, opt)
    ck.close()
    assert not a_89.exists()


def test_new_records_are_not_replayed_on_the_old_state(tmp_path: Path) -> None:
    """The reverse: A's full checkpoint at 8 comes back (B's was lost, and retention
    had removed the older ones); B's records from 8 on must not be applied to it."""
    root, aside = tmp_path / "ckpt", tmp_path / "aside"
    r = _two_runs(root, aside, b_batch=1)
    full8 = layout.full_path(root, 8)
    shutil.copy2(aside / full8.name, full8)  # replaces B's full checkpoint at 8
    for s in (0, 4):
        layout.full_path(root, s).unlink()
    b_88 = layout.records_path(root, 8, 8)
    assert _meta(full8)["run_id"] == r["a_run"]
    assert _meta(b_88)["follows"] == r["b_run"]
    # the condition: B's record of step 8 is not A's
    assert not torch.equal(_row(aside / layout.records_path(root, 8, 9).name, 8), _row(b_88, 8))

    got, model, opt, msgs = _restore(root)
    # the newest consistent step: A's full checkpoint, nothing of B on top
    assert got == 8
    assert _equal(r["a"][8], model, opt)
    assert len(msgs) == 1
    assert b_88.name in msgs[0] and r["a_run"] in msgs[0] and r["b_run"] in msgs[0]
    assert lowdiff.inspect_dir(root).recoverable_intervals == [(8, 8)]
    with pytest.raises(lowdiff.RecoveryError, match="not recoverable"):
        lowdiff.restore(root, *_build(seed=3), step=9)


def test_files_without_lineage_recover_as_before(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    r = _two_runs(root, tmp_path / "aside", b_batch=3)
    for p in sorted((root / layout.RECORDS_DIR).iterdir()):
        lf = sfile.read(p)
        md = {k: v for k, v in lf.metadata.items() if k != "follows"}
        entries, blob = sfile.pack(lf.tensors)
        sfile.write(p, entries, blob, md)
        assert "follows" not in _meta(p)
    assert recoverable_intervals(scan(root)) == [(0, TOTAL)]
    got, model, opt, msgs = _restore(root)
    assert (got, msgs) == (TOTAL, [])
    assert _equal(r["b"][TOTAL], model, opt)


# -- the chain search and the sharded plan, on headers alone ----------------------------


def _scan(fulls: dict[int, str], records: list[tuple[int, int, str, str | None]]) -> Scan:
    sc = Scan(Path("/nowhere"), {})
    sc.fulls = [
        FileInfo(Path(f"/nowhere/full-{s}"), "full", s, s, 1, 0, run_id=run)
        for s, run in sorted(fulls.items())
    ]
    sc.records = [
        FileInfo(Path(f"/nowhere/rec-{a}-{b}-{run}"), "records", a, b, 1, b - a + 1, run, fol)
        for a, b, run, fol in records
    ]
    return sc


def test_chain_follows_one_trajectory() -> None:
    # A: 0..7 in files of 2; B resumed from A's state at 4, files of 1; A's [4, 5] and
    # [6, 7] are back (A's trajectory past 4 was abandoned when B resumed)
    records: list[tuple[int, int, str, str | None]] = [
        (0, 1, "A", "A"),
        (2, 3, "A", "A"),
        (4, 5, "A", "A"),
        (6, 7, "A", "A"),
        (4, 4, "B", "A"),
        (5, 5, "B", "B"),
        (6, 6, "B", "B"),
        (7, 7, "B", "B"),
    ]
    sc = _scan({0: "A"}, records)
    plan = make_plan(sc, None)
    assert plan.target == 8
    names = [f.path.name for f in plan.record_files]
    assert names == ["rec-0-1-A", "rec-2-3-A"] + [f"rec-{s}-{s}-B" for s in range(4, 8)]
    assert sorted(x.file.path.name for x in plan.foreign) == ["rec-4-5-A", "rec-6-7-A"]
    assert all("run B resumed from run A's state at step 4" in x.reason for x in plan.foreign)
    assert recoverable_intervals(sc) == [(0, 8)]
    # A's full checkpoint at 6 is abandoned too while an older one can serve B
    sc.fulls.append(FileInfo(Path("/nowhere/full-6"), "full", 6, 6, 1, 0, run_id="A"))
    assert make_plan(sc, None).full.first_step == 0
    assert make_plan(sc, 7).record_files[-1].path.name == "rec-6-6-B"
    # with no other full checkpoint, A's is still a consistent state; B's records do
    # not go on top of it
    sc.fulls = sc.fulls[1:]
    plan = make_plan(sc, None)
    assert (plan.full.first_step, plan.target, plan.record_files[0].path.name) == (
        6,
        8,
        "rec-6-7-A",
    )
    assert [(x.file.path.name, x.step) for x in plan.foreign] == [("rec-6-6-B", 6)]
    assert "follows run B at step 6, but the state at step 6 comes from run A" in (
        plan.foreign[0].reason
    )
    # a record that follows a run other than the state's, with no resumption in sight
    sc = _scan({0: "A"}, [(0, 1, "A", "A"), (2, 3, "C", "X")])
    assert make_plan(sc, None).target == 2
    # unknown lineage on either side chains as before
    sc = _scan({0: "A"}, [(0, 1, "A", None), (2, 3, "B", None)])
    assert make_plan(sc, None).target == 4
    sc = _scan({0: None}, [(0, 1, "A", "X")])  # type: ignore[dict-item]
    assert make_plan(sc, None).target == 2


def test_sharded_plan_checks_each_shards_lineage() -> None:
    # each rank resumed at 4 (runs B0, B1 follow A0, A1); shard 0 also holds a file of
    # A0's abandoned trajectory that would reach 10
    s0 = _scan({0: "A0", 4: "A0"}, [(0, 3, "A0", "A0"), (4, 7, "B0", "A0"), (6, 9, "A0", "A0")])
    s1 = _scan({0: "A1", 4: "A1"}, [(0, 3, "A1", "A1"), (4, 5, "B1", "A1"), (6, 9, "B1", "B1")])
    assert plan_sharded([s0, s1], None) == (8, 4)
    s0.records.append(FileInfo(Path("/nowhere/rec-8-9-B0"), "records", 8, 9, 1, 2, "B0", "B0"))
    assert plan_sharded([s0, s1], None) == (10, 4)
    # a record file that does not follow its shard's state ends that shard's chain
    s1.records[-1].follows = "Z"
    assert plan_sharded([s0, s1], None) == (6, 4)
