"""strategy="naive-dc": full + top-k differential checkpoints, approximate by design.

Recovery rebuilds exactly the state the trainer kept as its base (full checkpoint plus
the chain of differentials). Against the uninterrupted training state that is exact for
the step, buffers, hyperparameters, scheduler and RNG, and approximate for the model
(top-k error) and the optimizer state (rounding of ``(new - base) + base``).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tests import launch
from tests.baselines import harness

import lowdiff
from lowdiff_lab.baselines.base import load_state
from lowdiff_lab.baselines.naive_dc import NaiveDCCheckpointer, recovery_error

STRATEGY = "naive-dc"
FULL_EVERY = 6
STEPS = 16  # fulls at 0, 6, 12 (0 removed by keep_full=2); differentials at every other step
MODEL_MAX_REL = 0.5
"""Documented bound for the harness model (Adam, lr 1e-2, ratio 0.01, <= 5 differentials
since the last full): no tensor's error exceeds half its largest magnitude. Measured:
about 0.14. The error of an entry is at most how far it moved since it was last selected,
which ``test_model_error_is_bounded_by_the_drift_since_the_full`` checks entry by entry."""
ROUNDING = 1e-6
"""Relative rounding of ``(new - base) + base`` in float32, with room to spare."""


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One training run of STEPS steps, kept open at the end to read the trainer's base."""
    d = tmp_path_factory.mktemp("naive-dc") / "ckpt"
    ck, objects, _ = harness.run(
        d, 0, STEPS, strategy=STRATEGY, full_every=FULL_EVERY, keep_full=2, close=False
    )
    assert isinstance(ck.strategy_impl, NaiveDCCheckpointer)
    base = {k: v.clone() for k, v in ck.strategy_impl._base_params.items()}
    ck.close()
    return {"dir": d, "base": base, "stats": ck.stats, "live": harness.state_of(objects)}


def _copy(written: dict[str, Any], tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(written["dir"], d)
    return d


def _resume(d: Path, **kwargs: Any) -> tuple[Any, Any, int]:
    """Resume ``d`` and train no further (no checkpointing process is started)."""
    kwargs.setdefault("full_every", FULL_EVERY)
    return harness.run(d, 0, 0, strategy=STRATEGY, close=False, **kwargs)


def _assert_model_is(base: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().reshape(-1), base[name]), name


def test_same_constructor_returns_the_baseline(tmp_path: Path) -> None:
    model, opt, _ = harness.build()
    ck = lowdiff.Checkpointer(model, opt, tmp_path / "c", strategy=STRATEGY, full_every=2)
    assert isinstance(ck.strategy_impl, NaiveDCCheckpointer) and ck.method == STRATEGY
    ck.close()


def test_files_retention_and_stats(written: dict[str, Any]) -> None:
    d = written["dir"]
    assert _names(d / "full") == [f"ckpt-{s:012d}.pt{c}" for s in (6, 12) for c in ("", ".commit")]
    # differentials older than the oldest kept full (steps 1-5) are gone
    want = [s for s in range(7, STEPS + 1) if s % FULL_EVERY]
    assert _names(d / "diffs") == [f"diff-{s:012d}.pt{c}" for s in want for c in ("", ".commit")]
    stats = written["stats"]
    assert stats["fulls"] == 3 and stats["diffs"] == STEPS - 2
    assert stats["checkpoints"] == STEPS and stats["durable_step"] == STEPS
    assert stats["compress_s"] > 0 and stats["stall_s"] >= stats["compress_s"]
    assert stats["diff_bytes"] > 0 and stats["full_bytes"] > 0
    assert stats["bytes_written"] == stats["diff_bytes"] + stats["full_bytes"]


def test_recovery_is_exact_where_designed_and_bounded_elsewhere(
    written: dict[str, Any], tmp_path: Path
) -> None:
    ck, objects, resumed = _resume(_copy(written, tmp_path))
    assert resumed == STEPS and ck.step_count == STEPS
    rs = ck.recovery_stats
    assert rs is not None and rs.full_step == 12 and rs.step == STEPS
    assert rs.records_replayed == STEPS - 12 and rs.files_read == 1 + STEPS - 12
    assert rs.bytes_read > 0 and rs.read_s > 0 and rs.decode_s > 0 and rs.replay_s > 0
    ck.close()
    # exactly what the trainer kept as its base: the chain replays bit for bit
    _assert_model_is(written["base"], objects[0])
    err = recovery_error(harness.reference(STEPS), harness.state_of(objects))
    # step counters, hyperparameters, buffers, scheduler and RNG states: bit-identical
    assert err["other_differences"] == []
    assert 0 < err["model_max_rel"] < MODEL_MAX_REL
    # optimizer differences are stored uncompressed: only float rounding remains
    assert err["optimizer_max_rel"] < ROUNDING


def test_model_error_is_bounded_by_the_drift_since_the_full(
    written: dict[str, Any], tmp_path: Path
) -> None:
    ck, objects, _ = _resume(_copy(written, tmp_path))
    ck.close()
    # Every entry holds a value it had at some checkpoint since the full (top-k picked it
    # then) or the full's value: errors never pile up beyond the entry's own movement.
    refs = [harness.reference(t) for t in range(12, STEPS + 1)]
    got = harness.state_of(objects)
    for name, _ in objects[0].named_parameters():
        k = f"model/{name}"
        want = refs[-1][k]
        drift = torch.stack([(want - r[k]).abs() for r in refs]).amax(0)
        assert ((got[k] - want).abs() <= drift + ROUNDING).all(), name


def test_ratio_one_is_exact_up_to_rounding_and_sessions_chain(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    opts: dict[str, Any] = {"ratio": 1.0, "compress_optimizer": True, "full_every": 100}
    harness.run(d, 0, 5, strategy=STRATEGY, **opts)
    # "w/ OC": optimizer differences are top-k payloads too (here keeping every entry)
    rec = load_state(d / "diffs" / "diff-000000000003.pt")
    assert {op["op"] for e in rec["optimizer"]["state"].values() for op in e.values()} == {"topk"}
    model, opt, sched = objects = harness.build()
    ck = lowdiff.Checkpointer(model, opt, d, strategy=STRATEGY, scheduler=sched, **opts)
    assert ck.resume() == 5
    want, got = harness.reference(5), harness.state_of(objects)
    err = recovery_error(want, got)
    assert err["other_differences"] == []
    # Differences are stored as (new - base) and added back: exact wherever new and base
    # are within a factor 2 of each other (Sterbenz), otherwise one rounding. So not
    # torch.equal, but within float32 rounding of the magnitudes involved.
    for k in want:
        if k.startswith(("model/", "optim/")) and want[k].is_floating_point():
            torch.testing.assert_close(got[k], want[k], rtol=ROUNDING, atol=1e-8)
    assert err["model_max_rel"] < ROUNDING and err["optimizer_max_rel"] < ROUNDING
    # the resumed session continues the same chain from the recovered state
    for t in range(5, 8):
        harness.train_step(model, t)
        ck.step()
        opt.zero_grad()
    assert isinstance(ck.strategy_impl, NaiveDCCheckpointer)
    base = {k: v.clone() for k, v in ck.strategy_impl._base_params.items()}
    live = harness.state_of(objects)
    ck.close()
    ck, objects, resumed = _resume(d, **opts)
    ck.close()
    assert resumed == 8 and ck.recovery_stats is not None
    assert ck.recovery_stats.full_step == 0 and ck.recovery_stats.records_replayed == 8
    _assert_model_is(base, objects[0])
    assert recovery_error(live, harness.state_of(objects))["other_differences"] == []


def _warned(w: list[warnings.WarningMessage], name: str) -> bool:
    return any(
        issubclass(x.category, lowdiff.RecoveryWarning) and name in str(x.message) for x in w
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-commit", "missing"])
def test_damaged_differential_stops_the_chain(
    written: dict[str, Any], tmp_path: Path, damage: str
) -> None:
    d = _copy(written, tmp_path)
    path = d / "diffs" / "diff-000000000014.pt"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 3]))
    elif damage == "no-commit":
        (d / "diffs" / "diff-000000000014.pt.commit").unlink()
    else:
        path.unlink()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ck, objects, resumed = _resume(d)
    ck.close()
    assert resumed == 13
    assert _warned(w, "diff-000000000014.pt")
    # nothing past the recovered step stays in the chain (a new run rewrites those steps)
    assert _names(d / "diffs")[-2:] == ["diff-000000000013.pt", "diff-000000000013.pt.commit"]
    moved = " ".join(_names(d / "quarantine"))
    assert "diff-000000000015.pt" in moved and "diff-000000000016.pt" in moved
    err = recovery_error(harness.reference(13), harness.state_of(objects))
    assert err["other_differences"] == [] and err["model_max_rel"] < MODEL_MAX_REL


def test_damaged_newest_full_falls_back_to_the_older_chain(
    written: dict[str, Any], tmp_path: Path
) -> None:
    d = _copy(written, tmp_path)
    full = d / "full" / "ckpt-000000000012.pt"
    raw = bytearray(full.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    full.write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ck, objects, resumed = _resume(d)
    ck.close()
    # full 6, differentials 7..11; diff 13 continues the damaged full 12, so it stops
    assert resumed == 11
    assert ck.recovery_stats is not None and ck.recovery_stats.full_step == 6
    assert _warned(w, "ckpt-000000000012.pt")
    err = recovery_error(harness.reference(11), harness.state_of(objects))
    assert err["other_differences"] == [] and err["model_max_rel"] < MODEL_MAX_REL


_CHILD = """
import os, signal, sys
from tests.baselines import harness
import lowdiff

model, opt, sched = harness.build()
ck = lowdiff.Checkpointer(model, opt, sys.argv[1], strategy="naive-dc", scheduler=sched,
                          full_every=5)
ck.resume()
for t in range(8):
    harness.train_step(model, t)
    ck.step()
    opt.zero_grad()
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no flush: records may still be in flight
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkill_of_the_trainer_then_resume(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
    proc = launch.run(
        [sys.executable, "-c", _CHILD, str(d)], cwd=root, env=env, timeout=120, check=False
    )
    assert proc.returncode == -signal.SIGKILL
    # The orphaned checkpointing process writes everything it was handed (resume waits
    # for it): full 5 and differentials 6, 7, 8.
    model, opt, sched = harness.build()
    ck = lowdiff.Checkpointer(model, opt, d, strategy=STRATEGY, scheduler=sched, full_every=5)
    assert ck.resume() == 8
    ck.close()
    assert ck.recovery_stats is not None and ck.recovery_stats.full_step == 5
    err = recovery_error(harness.reference(8), harness.state_of((model, opt, sched)))
    assert err["other_differences"] == [] and err["model_max_rel"] < MODEL_MAX_REL


def test_background_failure_is_raised_in_the_trainer(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    model, opt, sched = harness.build()
    ck = lowdiff.Checkpointer(model, opt, d, strategy=STRATEGY, scheduler=sched, full_every=50)
    ck.resume()
    (d / "diffs").write_bytes(b"")  # a file where the differentials directory goes
    with pytest.raises(lowdiff.CheckpointWorkerError, match="FileExistsError") as e:
        for t in range(10):
            harness.train_step(model, t)
            ck.step()
            opt.zero_grad()
        ck.flush()
    assert e.value.storage
    with pytest.raises(lowdiff.CheckpointWorkerError):
        ck.close()


def test_bad_options(tmp_path: Path) -> None:
    model, opt, _ = harness.build()
    d = tmp_path / "c"
    for option, value, error in [
        ("diff_every", 0, ValueError),
        ("diff_every", 1.5, TypeError),
        ("ratio", 0.0, ValueError),
        ("ratio", 1.5, ValueError),
        ("ratio", float("nan"), ValueError),
        ("ratio", "0.1", TypeError),
        ("compress_optimizer", "yes", TypeError),
        ("max_inflight", 0, ValueError),
        ("full_every", 0, ValueError),
    ]:
        with pytest.raises(error, match=option):
            lowdiff.Checkpointer(model, opt, d, strategy=STRATEGY, **{option: value})
    with pytest.raises(TypeError, match="batch_size"):
        lowdiff.Checkpointer(model, opt, d, strategy=STRATEGY, batch_size=3)
    # a rejected construction leaves the directory free
    lowdiff.Checkpointer(model, opt, d, strategy=STRATEGY).close()


def test_recovery_error_measures_each_group() -> None:
    want = {
        "model/w": torch.tensor([1.0, -2.0]),
        "model/n": torch.tensor(3),
        "optim/state[0].exp_avg": torch.tensor([0.5, 0.25]),
        "rng.torch": torch.tensor([1, 2], dtype=torch.uint8),
    }
    assert recovery_error(want, dict(want)) == {
        "model_max_abs": 0.0,
        "model_max_rel": 0.0,
        "model_rel_l2": 0.0,
        "optimizer_max_abs": 0.0,
        "optimizer_max_rel": 0.0,
        "optimizer_rel_l2": 0.0,
        "other_differences": [],
    }
    got = dict(want)
    got["model/w"] = torch.tensor([1.0, -2.5])
    got["optim/state[0].exp_avg"] = torch.tensor([0.5, 0.5])
    got["rng.torch"] = torch.tensor([1, 3], dtype=torch.uint8)
    del got["model/n"]
    err = recovery_error(want, got)
    assert err["model_max_abs"] == 0.5 and err["model_max_rel"] == 0.25
    assert err["model_rel_l2"] == pytest.approx(0.5 / 5**0.5)
    assert err["optimizer_max_abs"] == 0.25 and err["optimizer_max_rel"] == 0.5
    assert err["other_differences"] == ["missing model/n", "rng.torch"]
