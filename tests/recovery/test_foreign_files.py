"""Files copied in from elsewhere, with valid checksums: a full checkpoint or record file of
another run of the same job, of another model, and a file that is not a regular file.
Each is named and left out; nothing of it is loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.format import layout
from lowdiff.state.capture import diff_states, snapshot_state

pytestmark = pytest.mark.multiprocess

N_STEPS = 9  # LowDiff: fulls 0, 4, 8 (keep_full None); records 0-2, 3-5, 6-8


def _build(seed: int, width: int = 12) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(d: Path, strategy: str, seed: int, width: int = 12) -> dict[int, Any]:
    """A run of ``N_STEPS`` steps in ``d``; the state after each step."""
    model, opt = _build(seed, width)
    kw: dict[str, Any] = {"strategy": strategy, "keep_full": None}
    if strategy == "lowdiff":
        kw.update(compressor=lowdiff.TopK(0.3, error_feedback=False), full_every=4, batch_size=3)
    else:
        kw.update(persist_every=4)
    snaps = {0: snapshot_state(model, opt, None)}
    with lowdiff.Checkpointer(model, opt, d, **kw) as ck:
        ck.resume()
        for t in range(N_STEPS):
            g = torch.Generator().manual_seed(t)
            loss = ((model(torch.randn(5, 6, generator=g)) - 1) ** 2).mean()
            loss.backward()
            ck.step()
            opt.zero_grad()
            snaps[t + 1] = snapshot_state(model, opt, None)
    return snaps


@pytest.fixture(scope="module", params=["lowdiff", "lowdiff+"])
def runs(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Path, Path, dict[int, Any]]:
    """This run, another run of the same job (another seed), and a run of a wider model."""
    base = tmp_path_factory.mktemp("foreign")
    mine, other, wider = base / "mine", base / "other", base / "wider"
    snaps = _train(mine, request.param, seed=0)
    _train(other, request.param, seed=1)
    _train(wider, request.param, seed=0, width=16)
    return request.param, mine, other, wider, snaps


def _copy_in(runs: Any, tmp_path: Path, source: Path, name: str) -> tuple[Path, Path]:
    d = tmp_path / "ck"
    shutil.copytree(runs[1], d, ignore=shutil.ignore_patterns(".lowdiff*"))
    planted = d / name
    shutil.copyfile(source / name, planted)
    return d, planted


def _restored(d: Path, step: int | None) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt = _build(5)
    got = lowdiff.restore(d, model, opt, step=step)
    return got, snapshot_state(model, opt, None)


FULL8 = "full/full-000000000008.safetensors"


@pytest.mark.parametrize("source", ["other", "wider"])
def test_a_full_checkpoint_of_another_run_is_named_and_never_loaded(
    runs: Any, tmp_path: Path, source: str
) -> None:
    strategy, _, other, wider, snaps = runs
    d, planted = _copy_in(runs, tmp_path, other if source == "other" else wider, FULL8)
    assert lowdiff.verify_dir(d)[1] == [(planted, lowdiff.inspect_dir(d).problems[0][1])]
    why = lowdiff.inspect_dir(d).problems[0][1]
    assert ("another model layout" if source == "wider" else "none of this directory's runs") in why
    # the newest step and step 8 itself come from this run's own files, with a warning
    for step in (None, 8):
        if strategy == "lowdiff+" and step == 8:  # only full checkpoints: 8 went with the file
            with (
                pytest.raises(lowdiff.RecoveryError, match=f"step 8 is not.*{planted.name}"),
                pytest.warns(lowdiff.RecoveryWarning, match=planted.name),
            ):
                _restored(d, step)
            continue
        with pytest.warns(lowdiff.RecoveryWarning, match=planted.name):
            got, state = _restored(d, step)
        assert got == (N_STEPS if step is None else step)
        assert diff_states(state, snaps[got]) == []
    # resume() moves it to quarantine/ and goes on from this run's own state
    model, opt = _build(5)
    kw: dict[str, Any] = {"strategy": strategy}
    if strategy == "lowdiff":
        kw.update(compressor=lowdiff.TopK(0.3, error_feedback=False), full_every=4, batch_size=3)
    with pytest.warns(lowdiff.RecoveryWarning, match=planted.name):
        ck = lowdiff.Checkpointer(model, opt, d, keep_full=None, **kw)
        try:
            assert ck.resume() == N_STEPS
        finally:
            ck.close()
    assert diff_states(snapshot_state(model, opt, None), snaps[N_STEPS]) == []
    assert not planted.exists()
    moved = [p.name for p in (d / "quarantine").rglob("*.safetensors")]
    assert len(moved) == 1 and moved[0].endswith(planted.name)


@pytest.fixture()
def only_lowdiff(runs: Any) -> None:
    if runs[0] != "lowdiff":
        pytest.skip("record files: LowDiff only")


def test_a_record_file_of_another_run_is_named_by_inspect_and_by_the_step_error(
    runs: Any, only_lowdiff: None, tmp_path: Path
) -> None:
    name = "records/rec-000000000006-000000000008.safetensors"
    d, planted = _copy_in(runs, tmp_path, runs[2], name)
    out = subprocess.run(
        [sys.executable, "-m", "lowdiff", "inspect", "--json", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    doc = json.loads(out.stdout)
    assert doc["recoverable_intervals"] == [[0, 6], [8, 8]]  # records 6..8 left out
    assert [p["path"] for p in doc["problems"]] == [str(planted)]
    model, opt = _build(5)
    with (
        pytest.raises(lowdiff.RecoveryError, match=f"step 9 is not recoverable.*{planted.name}"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", lowdiff.RecoveryWarning)
        lowdiff.restore(d, model, opt, step=9)


def test_the_manifest_lists_every_run_and_an_older_one_checks_the_layout_alone(
    runs: Any, tmp_path: Path
) -> None:
    strategy, mine, other, _, snaps = runs
    # a resumed session adds its run to those of the directory
    d = tmp_path / "ck"
    shutil.copytree(mine, d, ignore=shutil.ignore_patterns(".lowdiff*"))
    before = layout.read_manifest(d)["runs"]
    assert len(before) == 1
    model, opt = _build(5)
    kw: dict[str, Any] = {"strategy": strategy, "keep_full": None}
    if strategy == "lowdiff":
        kw.update(compressor=lowdiff.TopK(0.3, error_feedback=False), full_every=4, batch_size=3)
    with lowdiff.Checkpointer(model, opt, d, **kw) as ck:
        assert ck.resume() == N_STEPS
        loss = ((model(torch.ones(5, 6)) - 1) ** 2).mean()
        loss.backward()
        ck.step()
    after = layout.read_manifest(d)["runs"]
    assert after[:-1] == before and after[-1] not in before
    assert lowdiff.inspect_dir(d).problems == []
    # a manifest without the list (an older lowdiff's) cannot tell the runs apart
    old = tmp_path / "old"
    shutil.copytree(mine, old, ignore=shutil.ignore_patterns(".lowdiff*"))
    body = layout.read_manifest(old)
    del body["runs"]
    layout.write_manifest(old, body)
    shutil.copyfile(other / FULL8, old / FULL8)
    assert lowdiff.inspect_dir(old).problems == []


@pytest.mark.parametrize("name", [FULL8, "lowdiff.json"])
def test_a_named_pipe_in_place_of_a_file_is_named_at_once(
    runs: Any, tmp_path: Path, name: str
) -> None:
    d = tmp_path / "ck"
    shutil.copytree(runs[1], d, ignore=shutil.ignore_patterns(".lowdiff*"))
    (d / name).unlink()
    os.mkfifo(d / name)
    cmd = [sys.executable, "-m", "lowdiff", "verify", str(d)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode in (1, 2), out
    assert f"{d / name}" in out.stdout + out.stderr
    assert "not a regular file" in out.stdout + out.stderr
