"""strategy="checkfreq": pipelined snapshot + persist process, exact recovery, the policy."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tests import launch
from tests.baselines import harness

import lowdiff
from lowdiff.format import layout
from lowdiff_lab.baselines import base
from lowdiff_lab.baselines import checkfreq as cf
from lowdiff_lab.baselines import checkfreq_layout as cfl

REPO = Path(__file__).resolve().parents[2]


def _train(ck: lowdiff.Checkpointer, objects: tuple, start: int, stop: int) -> None:
    model, opt, _ = objects
    for t in range(start, stop):
        harness.train_step(model, t)
        ck.step()
        opt.zero_grad()


def _steps_on_disk(d: Path) -> list[int]:
    return [s for s, _ in base.published(d / layout.FULL_DIR, cf.PREFIX, cf.SUFFIX)]


def _restore_file(d: Path, step: int) -> tuple:
    """A fresh training job with the state of checkpoint ``step`` loaded (no process)."""
    objects = harness.build(seed=1)
    state = base.load_state(d / layout.FULL_DIR / f"{cf.PREFIX}{step:012d}{cf.SUFFIX}")
    base.restore_state(state, *objects, where="test")
    return objects


# --------------------------------------------------------------------------- the policy


def test_choose_interval_takes_the_binding_constraint() -> None:
    assert cf.choose_interval(0.1, 0.0, 0.0, 0.035) == 1
    assert cf.choose_interval(0.1, 0.05, 0.0, 0.1) == 5  # overhead: 0.05 / (5 * 0.1) = 10 %
    assert cf.choose_interval(0.1, 0.0, 0.75, 0.035) == 8  # one in flight: 8 * 0.1 >= 0.75
    assert cf.choose_interval(0.1, 0.02, 0.35, 0.05) == 4
    # exact quotients are not rounded up by floating-point error
    assert cf.choose_interval(0.1, 0.0, 0.3, 0.5) == 3
    assert cf.choose_interval(0.1, 0.0, 0.7, 0.5) == 7
    assert cf.choose_interval(0.1, 0.035 * 0.1 * 4, 0.0, 0.035) == 4


def test_choose_interval_is_the_smallest_that_meets_both() -> None:
    for iter_s in (0.003, 0.05, 1.7):
        for stall in (0.0, 0.001, 0.04, 2.0):
            for persist in (0.0, 0.01, 0.9, 30.0):
                for bound in (0.01, 0.035, 0.5):
                    k = cf.choose_interval(iter_s, stall, persist, bound)
                    assert k >= 1
                    assert stall / (k * iter_s) <= bound * (1 + 1e-9)
                    assert k * iter_s >= persist * (1 - 1e-9)
                    if k > 1:
                        j = k - 1
                        assert stall / (j * iter_s) > bound or j * iter_s < persist


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0.0, 0.1, 0.1, 0.035), "iter_s"),
        ((-1.0, 0.1, 0.1, 0.035), "iter_s"),
        ((0.1, -0.1, 0.1, 0.035), "snapshot_stall_s"),
        ((0.1, math.nan, 0.1, 0.035), "snapshot_stall_s"),
        ((0.1, 0.1, math.inf, 0.035), "persist_s"),
        ((0.1, 0.1, 0.1, 0.0), "bound"),
        ((0.1, 0.1, 0.1, 1.0), "bound"),
    ],
)
def test_choose_interval_rejects_bad_input(args: tuple, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        cf.choose_interval(*args)


# --------------------------------------------------------------------------- options


def test_constructor_and_bad_options(tmp_path: Path) -> None:
    model, opt, _ = harness.build()
    ck = lowdiff.Checkpointer(tmp_path / "ok", model, opt, method="checkfreq", full_every=4)
    assert (
        isinstance(ck.strategy_impl, cf.CheckFreqCheckpointer)
        and ck.strategy_impl.interval == 4 == ck.strategy_impl.full_every
    )
    ck.close()
    bad: list[tuple[type[Exception], str, dict]] = [
        (ValueError, "full_every", {"full_every": "often"}),
        (ValueError, "full_every", {"full_every": 0}),
        (TypeError, "full_every", {"full_every": 2.5}),
        (ValueError, "overhead_bound", {"overhead_bound": 0.0}),
        (ValueError, "overhead_bound", {"overhead_bound": 1.5}),
        (ValueError, "overhead_bound", {"overhead_bound": math.nan}),
        (TypeError, "overhead_bound", {"overhead_bound": "3%"}),
        (ValueError, "profile_steps", {"profile_steps": 0}),
        (TypeError, "profile_steps", {"profile_steps": 2.0}),
        (ValueError, "keep_full", {"keep_full": 0}),
        (TypeError, "batch_size", {"batch_size": 3}),
    ]
    for i, (exc, name, kwargs) in enumerate(bad):
        with pytest.raises(exc, match=name):
            lowdiff.Checkpointer(model, opt, tmp_path / f"b{i}", strategy="checkfreq", **kwargs)


# --------------------------------------------------------------------------- recovery


def test_resume_is_exact_and_continues_like_uninterrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slow snapshot thread: the next update must wait for it, or checkpoint 6 would
    # hold parameters after update 6 beside the buffers and RNG of step 6.
    copy_all = cf._copy_all

    def slow_copy(*args: object, **kwargs: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.15)
        copy_all(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cf, "_copy_all", slow_copy)
    d = tmp_path / "ckpt"
    ck, _, _ = harness.run(d, 0, 7, strategy="checkfreq", full_every=3, keep_full=2)
    assert ck.durable_step == 6 and _steps_on_disk(d) == [3, 6]  # retention keeps 2
    st = ck.stats
    assert st["checkpoints"] == 2 and st["interval"] == 3  # 3 and 6 (0 is the start)
    assert st["snapshot_wait_s"] > 0.1  # the update waited for the snapshot
    assert st["snapshot_s"] > 0 and st["persist_s"] > 0 and st["bytes_written"] > 0
    monkeypatch.setattr(cf, "_copy_all", copy_all)

    objects = harness.build()
    ck = lowdiff.Checkpointer(
        *objects[:2], d, strategy="checkfreq", scheduler=objects[2], full_every=3
    )
    assert ck.resume() == 6  # step 7 was never checkpointed
    assert ck.recovery_stats is not None and ck.recovery_stats.bytes_read > 0
    harness.assert_exact(harness.reference(6), objects)
    _train(ck, objects, 6, 11)
    ck.close()
    harness.assert_exact(harness.reference(11), objects)
    assert _steps_on_disk(d) == [6, 9]
    # the files are those of torch-save: any step's file restores exactly
    harness.assert_exact(harness.reference(9), _restore_file(d, 9))


_CHILD = """
import sys, time
import torch
import lowdiff
from tests.baselines import harness

def main():
    torch.set_num_threads(1)
    model, opt, sched = harness.build()
    ck = lowdiff.Checkpointer(model, opt, sys.argv[1], strategy="checkfreq",
                              scheduler=sched, full_every=2, keep_full=3)
    ck.resume()
    for t in range(100000):
        harness.train_step(model, t)
        ck.step()
        opt.zero_grad()
        print(f"step {t + 1} durable {ck.durable_step}", flush=True)
        time.sleep(0.005)

if __name__ == "__main__":
    main()
"""


@pytest.mark.multiprocess
def test_sigkill_of_the_trainer_recovers_the_durable_state(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    d = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]))
    proc = launch.popen(
        [sys.executable, str(script), str(d)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    watchdog = threading.Timer(90, proc.kill)
    watchdog.start()
    durable = -1
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            durable = max(durable, int(line.split()[3]))
            if durable >= 8:
                proc.send_signal(signal.SIGKILL)
                break
        rest = proc.stdout.read()  # lines printed before the kill landed
        durable = max([durable, *(int(x.split()[3]) for x in rest.splitlines())])
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and durable >= 8

    objects = harness.build(seed=1)
    ck = lowdiff.Checkpointer(
        *objects[:2], d, strategy="checkfreq", scheduler=objects[2], full_every=2
    )
    resumed = ck.resume()  # waits for the orphaned persist process to finish
    try:
        assert resumed >= durable and resumed % 2 == 0
        harness.assert_exact(harness.reference(resumed), objects)
    finally:
        ck.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("fault", "storage", "says"),
    [
        ("before_write:full:3:enospc", True, "No space left"),  # ckpt-0 and its commit pass
        ("before_rename:full:3:kill-self", False, "exit code -9"),
    ],
)
def test_persist_failure_is_raised_in_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, storage: bool, says: str
) -> None:
    monkeypatch.setenv("LOWDIFF_FAULTS", fault)  # read by the persist process only
    d = tmp_path / "ckpt"
    objects = harness.build()
    ck = lowdiff.Checkpointer(
        *objects[:2], d, strategy="checkfreq", scheduler=objects[2], full_every=2
    )
    ck.resume()
    with pytest.raises(lowdiff.CheckpointWorkerError, match=says) as ei:
        _train(ck, objects, 0, 20)
        ck.flush()
    assert ei.value.storage is storage
    assert ck.durable_step == 0
    with pytest.raises(lowdiff.CheckpointWorkerError, match=says):
        ck.step()
    with pytest.raises(lowdiff.CheckpointWorkerError, match=says):
        ck.close()
    # nothing torn was published, and the directory is free again
    assert _steps_on_disk(d) == [0]
    if storage:  # a failed write removes its temp file (a killed one leaves it to resume)
        assert not [p for p in (d / layout.FULL_DIR).iterdir() if p.name.startswith(".tmp-")]
    lowdiff.Checkpointer(*objects[:2], d, strategy="checkfreq").close()


# --------------------------------------------------------------------------- adaptive interval


@pytest.mark.multiprocess
def test_auto_profiles_then_picks_an_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lowdiff_lab.baselines.checkfreq")
    d = tmp_path / "ckpt"
    objects = harness.build()
    ck = lowdiff.Checkpointer(
        *objects[:2],
        d,
        strategy="checkfreq",
        scheduler=objects[2],
        full_every="auto",
        overhead_bound=0.5,
        profile_steps=3,
        keep_full=None,
    )
    ck.resume()
    assert ck.strategy_impl.interval is None and "full_every='auto'" in repr(ck)
    t = 0
    while ck.strategy_impl.interval is None:
        assert t < 1000, "no interval chosen"
        _train(ck, objects, t, t + 1)
        t += 1
    k = ck.strategy_impl.interval
    chosen_at = t
    _train(ck, objects, t, t + 2 * k + 1)
    t += 2 * k + 1
    ck.flush()
    st = ck.stats
    ck.close()
    assert k >= 1 and st["interval"] == k
    assert st["iter_s"] > 0 and st["snapshot_stall_s"] > 0 and st["persist_s"] > 0
    records = [r for r in caplog.records if r.name == "lowdiff_lab.baselines.checkfreq"]
    assert len(records) == 1 and f"every {k} steps" in records[0].getMessage()
    assert layout.read_manifest(d)["full_every"] == "auto"

    steps = _steps_on_disk(d)
    probe = steps[1]  # step 0, then the measuring checkpoint after >= 3 timed iterations
    assert 3 < probe < chosen_at
    assert steps[2:] == [s for s in range(chosen_at, t + 1) if s % k == 0]
    assert len(steps[2:]) >= 2
    harness.assert_exact(harness.reference(probe), _restore_file(d, probe))
    harness.assert_exact(harness.reference(steps[-1]), _restore_file(d, steps[-1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_is_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ck = lowdiff.Checkpointer(tmp_path / "c", model, opt, method="checkfreq", full_every=1)
    ck.resume()
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(5):
        x = torch.randn(32, 64, device="cuda", generator=g)
        model(x).square().mean().backward()
        ck.step()
        opt.zero_grad()
    ck.close()
    state = base.load_state(tmp_path / "c" / layout.FULL_DIR / f"{cf.PREFIX}{5:012d}{cf.SUFFIX}")
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v.cpu()), k
    for i, s in opt.state_dict()["state"].items():
        for name, v in s.items():
            assert torch.equal(state["optimizer"]["state"][i][name], v.cpu()), (i, name)


# --------------------------------------------------------------------------- tied weights


class _Tied(torch.nn.Module):
    """An embedding and an output layer that share one weight (as GPT-2's lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(40, 24)
        self.head = torch.nn.Linear(24, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x)))


def _tied_run(d: Path, strategy: str, steps: int) -> tuple[_Tied, lowdiff.Checkpointer]:
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ck = lowdiff.Checkpointer(model, opt, d, strategy=strategy, full_every=1)
    start = ck.resume()
    for t in range(start, steps):
        g = torch.Generator().manual_seed(t)
        x = torch.randint(0, 40, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x), x).backward()
        ck.step()
        opt.zero_grad()
    return model, ck


def test_flattener_keeps_one_leaf_per_tied_tensor() -> None:
    model = _Tied()
    sd = model.state_dict()
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    fl = cfl.Flattener({p.data_ptr() for p in model.parameters()})
    skeleton = fl.flatten({"model": sd, "buffers": {"other": torch.zeros(3)}})
    assert len(fl.leaves) == 2 and fl.deferrable == [True, False]
    assert skeleton["model"]["emb.weight"] == skeleton["model"]["head.weight"]
    rebuilt = cfl.rebuild(skeleton, [t.clone() for t in fl.leaves])
    assert rebuilt["model"]["emb.weight"] is rebuilt["model"]["head.weight"]
    # a view of the same memory with another shape is its own leaf
    fl2 = cfl.Flattener(set())
    w = model.emb.weight.detach()
    fl2.flatten({"a": w, "b": w.view(-1)})
    assert len(fl2.leaves) == 2


def test_tied_weights_are_written_once_and_resume_tied(tmp_path: Path) -> None:
    _, ck = _tied_run(tmp_path / "cf", "checkfreq", 3)
    ck.close()
    _, ck_ts = _tied_run(tmp_path / "ts", "torch-save", 3)
    ck_ts.close()
    name = f"{cf.PREFIX}{3:012d}{cf.SUFFIX}"
    size_cf = (tmp_path / "cf" / layout.FULL_DIR / name).stat().st_size
    size_ts = (tmp_path / "ts" / layout.FULL_DIR / name).stat().st_size
    weight = 40 * 24 * 4
    # the shared weight is stored once, as torch.save stores it (the files differ only in
    # a few bytes of pickle and zip metadata); stored twice, it would add ``weight`` bytes
    assert abs(size_cf - size_ts) < weight // 4
    model, ck = _tied_run(tmp_path / "cf", "checkfreq", 3)
    ref, ck_ref = _tied_run(tmp_path / "ts", "torch-save", 3)
    try:
        assert ck.step_count == 3 and model.head.weight is model.emb.weight
        assert torch.equal(model.emb.weight, ref.emb.weight)
    finally:
        ck.close()
        ck_ref.close()
