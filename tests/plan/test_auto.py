"""``full_every="auto"`` and ``batch_size="auto"``: the tuner, its switches, and recovery across them."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff
from lowdiff.format import layout
from lowdiff.plan import MTBF_ENV, AutoTuner, resolve_mtbf
from lowdiff.state.capture import diff_states, snapshot_state, state_tensors

# --------------------------------------------------------------------------- the tuner alone


def _profiled(**kw: Any) -> AutoTuner:
    t = AutoTuner(record_bytes=1000, mtbf=3600.0, profile_steps=2, **kw)
    for _ in range(2):
        t.observe_iteration(0.1)
        t.observe_record_file(3, 3200, 0.003)
        t.observe_optimizer_step(0.002)
        t.observe_decompress(0.001)
        t.observe_full_copy(0.01)
    t.observe_full(10**7, 0.2)
    return t


def test_tuner_waits_for_its_profile():
    t = AutoTuner(record_bytes=1000, mtbf=3600.0, profile_steps=3)
    assert (t.f, t.b) == (30, 3) and not t.ready and not t.due(100)
    t.observe_iteration(0.1)
    t.observe_full(10**6, 0.1)
    t.observe_record_file(3, 3000, 0.01)
    assert not t.ready  # one iteration of three
    t.observe_iteration(0.1)
    t.observe_iteration(0.1)
    assert t.ready and t.due(5)


def test_a_measured_recovery_raises_the_replay_cost_per_record():
    t = _profiled()  # optimizer step 2 ms, decompression 1 ms a record
    assert t.model(10**7).replay_s_per_record == pytest.approx(0.002)
    t.observe_recovery(10, 0.05)  # 5 ms a record in a real recovery
    m = t.model(10**7)
    assert m.replay_s_per_record == pytest.approx(0.004)  # 5 ms less the decompression
    assert m.r_b(1) > t.model(10**7).s_b(1) / m.read_bw + 0.005 - 1e-9
    fast = _profiled()
    fast.observe_recovery(10, 0.001)  # faster than the profile says: the profile stands
    assert fast.model(10**7).replay_s_per_record == pytest.approx(0.002)
    fast.observe_recovery(0, 1.0)  # nothing replayed: no measurement
    assert fast._recovered.n == 1


def test_tuner_plans_the_argmin_of_its_model():
    from lowdiff.plan import optimize

    t = _profiled()
    entry = t.decide(step=12, full_bytes=10**7)
    assert entry is not None and entry["reason"] == "profiled"
    p = optimize(t.model(10**7))  # the full grid search agrees with the tuner's
    assert (entry["f"], entry["b"]) == (p.f, p.b) == (t.f, t.b)
    assert entry["wasted_s"] == p.wasted_s and entry["previous_wasted_s"] > p.wasted_s
    assert (entry["previous_f"], entry["previous_b"]) == (30, 3)
    assert (
        entry["inputs"]["mtbf"] == 3600.0
        and entry["inputs"]["read_bw"] == entry["inputs"]["write_bw"]
    )
    assert t.history == [entry]


def test_tuner_model_inputs():
    t = _profiled()
    m = t.model(5 * 10**6)
    assert m.tau == pytest.approx(0.1) and m.record_bytes == 1000
    assert m.batch_overhead_bytes == pytest.approx(200.0)
    assert m.full_bytes == 10**7  # the larger of the state now and the last full file
    # W and the latency from the two write sizes: 3200 B in 3 ms, 10 MB in 200 ms
    slope = (0.2 - 0.003) / (10**7 - 3200)
    assert m.write_bw == pytest.approx(1 / slope)
    assert m.batch_latency == pytest.approx(0.003 - 3200 * slope) == m.full_latency
    assert m.full_recovery_s == pytest.approx(10**7 * slope + 0.01)
    assert m.replay_s_per_record == pytest.approx(0.002)
    assert m.decompress_s_per_record == pytest.approx(0.001)


def test_tuner_hysteresis():
    t = _profiled()
    first = t.decide(step=12, full_bytes=10**7)
    assert first is not None
    # the same costs again: due after a full checkpoint (not sooner than profile_steps
    # after the last plan), but nothing changes
    t.observe_full(10**7, 0.2)
    assert not t.due(13) and t.due(14)
    assert t.decide(step=14, full_bytes=10**7) is None
    assert not t.due(15) and t.due(14 + t.replan_every)
    # a much slower disk: fewer, larger writes pay off
    for _ in range(20):
        t.observe_full(10**7, 20.0)
        t.observe_record_file(3, 3200, 0.3)
    second = t.decide(step=40, full_bytes=10**7)
    assert second is not None and second["reason"] == "re-planned"
    assert second["f"] > first["f"]
    assert second["wasted_s"] < (1 - t.margin) * second["previous_wasted_s"]


def test_tuner_with_one_knob_fixed():
    t = _profiled(tune_f=False, f=8)
    e = t.decide(step=12, full_bytes=10**7)
    assert t.f == 8 and 1 <= t.b <= 8
    assert e is None or e["f"] == 8
    t = _profiled(tune_b=False, b=40)
    assert t.f >= 40  # the start respects b <= f
    t.decide(step=12, full_bytes=10**7)
    assert t.b == 40 and t.f >= 40


def test_resolve_mtbf(monkeypatch):
    monkeypatch.delenv(MTBF_ENV, raising=False)
    assert resolve_mtbf(None) == (6 * 3600.0, "default")
    assert resolve_mtbf(120) == (120.0, "mtbf=")
    monkeypatch.setenv(MTBF_ENV, "90.5")
    assert resolve_mtbf(None) == (90.5, MTBF_ENV)
    assert resolve_mtbf(10.0) == (10.0, "mtbf=")  # the option wins
    monkeypatch.setenv(MTBF_ENV, "soon")
    with pytest.raises(
        ValueError, match="LOWDIFF_MTBF must be a number of seconds > 0, got 'soon'"
    ):
        resolve_mtbf(None)
    for bad in (0, -1.0, float("inf"), "1h", True):
        with pytest.raises(ValueError, match="mtbf must be a number of seconds > 0"):
            resolve_mtbf(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the Checkpointer


def _build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    return model, opt, sched


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    scale = 1.0 + 0.05 * random.random() + 0.05 * float(np.random.rand())
    return (
        (model(torch.randn(6, 8, generator=g) * scale) - torch.randn(6, 4, generator=g)) ** 2
    ).mean()


def _train(ck: Any, objs: tuple, start: int, stop: int, snaps: dict | None = None, hook=None):
    model, opt, sched = objs
    for step in range(start, stop):
        if hook is not None:
            hook(ck, step)
        _loss(model, step).backward()
        ck.step()
        opt.zero_grad()
        if snaps is not None:
            snaps[step + 1] = snapshot_state(model, opt, sched)


def _seed() -> None:
    random.seed(3)
    np.random.seed(3)


def _topk() -> lowdiff.TopK:
    # without error feedback: its residuals restart at zero on resume (documented), so a
    # resumed run equals the uninterrupted one only without them
    return lowdiff.TopK(ratio=0.25, error_feedback=False)


def _reference(n: int) -> dict[int, dict[str, torch.Tensor]]:
    """The uninterrupted run: the same compression, no checkpointing."""
    _seed()
    objs = _build()
    ck = lowdiff.Checkpointer(
        None, objs[0], objs[1], method="compression-only", scheduler=objs[2], compressor=_topk()
    )
    ck.resume()
    snaps = {0: snapshot_state(*objs)}
    _train(ck, objs, 0, n, snaps)
    ck.close()
    return snaps


def _files(d: Path) -> tuple[list[int], list[tuple[int, int]]]:
    info = lowdiff.inspect_dir(d)
    return (
        [f.first_step for f in info.full_checkpoints],
        [(f.first_step, f.n_records) for f in info.record_files],
    )


def _expected_files(history: list[dict], n: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Where the full checkpoints and record files of ``history``'s schedule fall.

    An entry made at step s (after s updates) applies from the next step: the next full
    checkpoint is due f steps after the previous one; records from step s on are batched
    b at a time (the partial batch before s is written at the switch).
    """
    fulls, files = [0], []
    batch: list[int] = []
    for k in range(1, n + 1):
        e = [h for h in history if h["step"] < k][-1]
        t = k - 1  # the record of step t is sent before the full checkpoint of step k
        switch = [h for h in history if h["step"] == t and h["b"] != h["previous_b"]]
        if switch and batch:
            files.append((batch[0], len(batch)))
            batch = []
        b = [h for h in history if h["step"] <= t][-1]["b"]
        batch.append(t)
        if len(batch) == b:
            files.append((batch[0], len(batch)))
            batch = []
        if k - fulls[-1] >= e["f"]:
            fulls.append(k)
    if batch:
        files.append((batch[0], len(batch)))
    return fulls, files


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "mtbf,want",
    [(1e9, "b=32"), (1e-9, "f=b=1")],
    ids=["failures-never", "failures-all-the-time"],
)
def test_auto_picks_and_applies_a_plan(tmp_path, mtbf, want, caplog):
    # The extremes make the argmin independent of the timings: without failures the
    # writes are all that count (b* = 32, the largest candidate); with failures all the
    # time the lost work and replay are (f* = b* = 1).
    n = 48
    _seed()
    objs = _build()
    ck = lowdiff.Checkpointer(
        tmp_path,
        objs[0],
        objs[1],
        scheduler=objs[2],
        full_every="auto",
        records_per_file="auto",
        mtbf=mtbf,
        keep_full=None,
        compressor=lowdiff.TopK(ratio=0.01),
    )
    with caplog.at_level(logging.INFO, logger="lowdiff.plan"):
        ck.resume()
        _train(ck, objs, 0, n)
        ck.close()
    h = ck.plan_history
    assert [e["reason"] for e in h[:2]] == ["start (profiling)", "profiled"]
    assert (h[0]["f"], h[0]["b"]) == (30, 3)
    switch = h[1]
    assert 10 <= switch["step"] < n
    if want == "b=32":
        assert switch["b"] == 32 and switch["f"] >= 32
    else:
        assert (switch["f"], switch["b"]) == (1, 1)
    assert ck.stats["full_every"] == h[-1]["f"] and ck.stats["records_per_file"] == h[-1]["b"]
    assert f"full_every 30 -> {switch['f']}, batch_size 3 -> {switch['b']}" in caplog.text
    # the files on disk follow the schedule of the history
    assert _files(tmp_path) == _expected_files(h, n)
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, n)
    # the manifest keeps what was configured
    m = layout.read_manifest(tmp_path)
    assert m["full_every"] == "auto" and m["batch_size"] == "auto"


@pytest.mark.multiprocess
def test_a_restarted_trainer_starts_from_the_previous_plan(tmp_path):
    """The plan is left in the directory: a trainer restarted on it with the same MTBF
    starts from that (f, b) instead of (30, 3); another MTBF, or a damaged plan file,
    starts from (30, 3). The file changes nothing in what is recovered."""

    def session(mtbf: float, start: int, stop: int) -> list[dict]:
        _seed()
        objs = _build()
        ck = lowdiff.Checkpointer(tmp_path, objs[0], objs[1], scheduler=objs[2], full_every="auto", records_per_file="auto", mtbf=mtbf, keep_full=None, compressor=lowdiff.TopK(ratio=0.01))  # fmt: skip
        assert ck.resume() == start
        _train(ck, objs, start, stop)
        ck.close()
        return ck.plan_history

    first = session(1e-9, 0, 24)  # failures all the time: f* = b* = 1
    assert (first[-1]["f"], first[-1]["b"]) == (1, 1)
    plan = tmp_path / layout.PLAN_FILE
    assert plan.exists()
    again = session(1e-9, 24, 30)
    assert again[0]["reason"] == "start (the previous session's plan; profiling)"
    assert (again[0]["f"], again[0]["b"]) == (1, 1)
    other = session(1e9, 30, 34)  # another MTBF: the plan was not made for it
    assert other[0]["reason"] == "start (profiling)" and (other[0]["f"], other[0]["b"]) == (30, 3)
    plan.write_text("{not json")
    damaged = session(1e9, 34, 36)
    assert damaged[0]["reason"] == "start (profiling)"
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, 36)
    assert lowdiff.verify_dir(tmp_path)[1] == []


@pytest.mark.multiprocess
def test_a_restarted_trainer_counts_replay_at_its_own_recovery_rate(tmp_path):
    """A trainer that replayed records at resume feeds their measured rate to its tuner:
    the replay cost per record it plans with is at least that rate less decompression."""

    def session(start: int, stop: int) -> Any:
        _seed()
        objs = _build()
        ck = lowdiff.Checkpointer(tmp_path, objs[0], objs[1], scheduler=objs[2], compressor=_topk(), full_every="auto", records_per_file="auto", mtbf=1e9)  # fmt: skip
        assert ck.resume() == start
        _train(ck, objs, start, stop)
        return ck

    first = session(0, 12)  # (30, 3) while profiling: one full checkpoint, at step 0
    first.close()
    ck = session(12, 14)
    stats = ck.recovery_stats
    assert stats is not None and stats.full_step == 0 and stats.records_replayed == 12
    assert 0 < stats.records_s <= stats.total_s
    tuner = ck.strategy_impl.autoplan.tuner
    assert tuner._recovered.n == 1
    rate = stats.records_s / stats.records_replayed
    assert tuner._replay_s_per_record() >= rate - tuner._dec.value - 1e-12
    ck.close()


def _force_at(plan: dict[int, tuple[int, int]]):
    def hook(ck: Any, step: int) -> None:
        if step == 0:
            ck.strategy_impl.autoplan.tuner.profile_steps = 10**9  # only the forced switches below
        if step in plan:
            ck.strategy_impl.set_plan(*plan[step])

    return hook


@pytest.mark.multiprocess
def test_recovery_across_switches_is_exact(tmp_path):
    n = 30
    ref = _reference(n + 8)
    # b grows mid-batch, shrinks mid-batch, f jumps below and above the last full
    plan = {5: (4, 3), 11: (7, 5), 17: (3, 2), 23: (12, 4)}
    _seed()
    objs = _build()
    ck = lowdiff.Checkpointer(
        tmp_path,
        objs[0],
        objs[1],
        scheduler=objs[2],
        compressor=_topk(),
        full_every="auto",
        records_per_file="auto",
        keep_full=None,
    )
    ck.resume()
    snaps = {0: snapshot_state(*objs)}
    _train(ck, objs, 0, n, snaps, hook=_force_at(plan))
    ck.close()
    # auto mode trains exactly as the run without checkpoints
    for s in range(n + 1):
        assert not diff_states(ref[s], snaps[s]), f"step {s} differs from the reference"
    h = ck.plan_history
    assert [(e["step"], e["f"], e["b"]) for e in h] == [(0, 30, 3)] + [
        (s, f, b) for s, (f, b) in plan.items()
    ]
    assert _files(tmp_path) == _expected_files(h, n)
    # every step restores bit for bit
    for s in range(n + 1):
        objs2 = _build(seed=100 + s)
        assert lowdiff.restore(tmp_path, *objs2[:2], objs2[2], step=s) == s
        bad = diff_states(snaps[s], state_tensors(*objs2))
        assert not bad, f"step {s} differs after restore: {bad[:6]}"
    # a resumed auto run continues exactly
    objs3 = _build(seed=7)
    ck3 = lowdiff.Checkpointer(
        tmp_path,
        objs3[0],
        objs3[1],
        scheduler=objs3[2],
        compressor=_topk(),
        full_every="auto",
        records_per_file="auto",
    )
    assert ck3.resume() == n
    _train(ck3, objs3, n, n + 8)
    ck3.close()
    assert not diff_states(ref[n + 8], state_tensors(*objs3))
    assert ck3.plan_history[0]["step"] == n


@pytest.mark.multiprocess
def test_changing_b_mid_batch_loses_no_record(tmp_path):
    n = 20
    objs = _build()
    ck = lowdiff.Checkpointer(
        tmp_path,
        objs[0],
        objs[1],
        scheduler=objs[2],
        full_every=50,
        records_per_file="auto",
        compressor=lowdiff.TopK(ratio=0.01),
    )
    ck.resume()
    # after 4 records (one waits in the batch of 3): b = 5; after 4 more (4 of 5): b = 2
    _train(ck, objs, 0, n, hook=_force_at({4: (50, 5), 8: (50, 2), 9: (50, 6)}))
    assert ck.flush() == n
    fulls, files = _files(tmp_path)
    assert files == [(0, 3), (3, 1), (4, 4), (8, 1), (9, 6), (15, 5)]
    covered = [s for first, k in files for s in range(first, first + k)]
    assert covered == list(range(n))
    assert fulls == [0]  # f was given as an integer and stays
    assert ck.stats["record_files_written"] == len(files)
    ck.close()
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, n)


@pytest.mark.multiprocess
def test_integer_settings_do_not_plan(tmp_path):
    objs = _build()
    ck = lowdiff.Checkpointer(
        tmp_path,
        objs[0],
        objs[1],
        full_every=4,
        records_per_file=3,
        mtbf=1.0,
        keep_full=None,
        compressor=lowdiff.TopK(ratio=0.01),
    )
    ck.resume()
    _train(ck, objs, 0, 14)
    ck.close()
    assert ck.plan_history == []
    assert ck.stats["full_every"] == 4 and ck.stats["records_per_file"] == 3
    m = layout.read_manifest(tmp_path)
    assert m["full_every"] == 4 and m["batch_size"] == 3
    assert _files(tmp_path) == ([0, 4, 8, 12], [(0, 3), (3, 3), (6, 3), (9, 3), (12, 2)])
    with pytest.raises(RuntimeError, match="'auto'"):
        ck.strategy_impl.set_plan(5, 2)


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    "kw,exc,msg",
    [
        (
            {"full_every": "sometimes"},
            ValueError,
            "full_every must be an int >= 1 or 'auto', got 'sometimes'",
        ),
        (
            {"batch_size": "AUTO"},
            ValueError,
            "batch_size must be an int >= 1 or 'auto', got 'AUTO'",
        ),
        (
            {"full_every": "auto", "mtbf": 0},
            ValueError,
            "mtbf must be a number of seconds > 0, got 0",
        ),
        ({"batch_size": "auto", "mtbf": "1h"}, ValueError, "mtbf must be a number of seconds > 0"),
        ({"full_every": 2.5}, TypeError, "full_every must be an int"),
        (
            {"strategy": "lowdiff+", "compressor": None, "full_every": "auto"},
            ValueError,
            "full_every='auto' is supported by method 'lowdiff' only",
        ),
    ],
)
def test_bad_values(tmp_path, kw, exc, msg):
    objs = _build()
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)")):
        lowdiff.Checkpointer(objs[0], objs[1], tmp_path, **kw)


def test_bad_environment_mtbf(tmp_path, monkeypatch):
    monkeypatch.setenv(MTBF_ENV, "-5")
    objs = _build()
    with pytest.raises(ValueError, match="LOWDIFF_MTBF must be a number of seconds > 0, got '-5'"):
        lowdiff.Checkpointer(
            tmp_path, objs[0], objs[1], full_every="auto", compressor=lowdiff.TopK(ratio=0.01)
        )
    # not read without "auto"
    lowdiff.Checkpointer(
        None,
        objs[0],
        objs[1],
        method="compression-only",
        full_every=5,
        compressor=lowdiff.TopK(ratio=0.01),
    )


def test_environment_mtbf_reaches_the_tuner(tmp_path, monkeypatch):
    monkeypatch.setenv(MTBF_ENV, "42")
    objs = _build()
    ck = lowdiff.Checkpointer(
        tmp_path, objs[0], objs[1], records_per_file="auto", compressor=lowdiff.TopK(ratio=0.01)
    )
    assert (
        ck.strategy_impl.autoplan.tuner is not None
        and ck.strategy_impl.autoplan.tuner.mtbf == 42.0
        and not ck.strategy_impl.autoplan.tuner.tune_f
    )
    ck.close()


def test_set_plan_checks_its_values(tmp_path):
    objs = _build()
    ck = lowdiff.Checkpointer(
        tmp_path, objs[0], objs[1], full_every="auto", compressor=lowdiff.TopK(ratio=0.01)
    )
    with pytest.raises(ValueError, match="need 1 <= b <= f, got f=2, b=3"):
        ck.strategy_impl.set_plan(2, 3)
    with pytest.raises(ValueError, match="b must be >= 1"):
        ck.strategy_impl.set_plan(2, 0)
    ck.close()


@pytest.mark.parametrize("knob", ["full_every", "batch_size"])
def test_ddp_refuses_auto(tmp_path, one_rank_group, knob):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(
        ValueError, match=f"{knob}='auto' is not supported under DistributedDataParallel"
    ):
        lowdiff.Checkpointer(model, opt, tmp_path / "ck", **{knob: "auto"})


@pytest.mark.multiprocess
def test_trainer_gone_after_a_switch_keeps_every_record(tmp_path):
    import gc

    n = 13
    objs = _build()
    ck = lowdiff.Checkpointer(
        tmp_path,
        objs[0],
        objs[1],
        scheduler=objs[2],
        full_every=50,
        records_per_file="auto",
        compressor=lowdiff.TopK(ratio=0.01),
    )
    ck.resume()
    _train(ck, objs, 0, n, hook=_force_at({5: (50, 4), 9: (50, 7)}))
    proc = ck.strategy_impl.worker_process
    del ck
    gc.collect()
    # the checkpointing process sees the trainer gone, writes what it was sent, exits
    proc.join(60)
    assert proc.exitcode == 0
    _, files = _files(tmp_path)
    assert files == [(0, 3), (3, 2), (5, 4), (9, 4)]
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, n)
