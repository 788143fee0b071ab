"""lowdiff.attach: an unmodified loop (optimizer.step(), scheduler.step()) is checkpointed
through the optimizer's own hooks, by the same pipeline as ck.step()."""

from __future__ import annotations

import pytest
import torch

import lowdiff
from lowdiff.state.capture import state_tensors


class Stream:
    def __init__(self) -> None:
        self.pos = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(500 + self.pos)
        self.pos += 1
        return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def _build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(16, 2),
    )
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s = torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=40)
    return m, o, s


def _snap(m, o, s, stream):
    d = {k: v.clone() for k, v in state_tensors(m, o, s).items()}
    d["data.pos"] = torch.tensor(stream.pos)
    d["rng"] = torch.get_rng_state()
    return d


def _restored(d, step):
    m, o, s = _build()
    stream = Stream()
    assert lowdiff.restore(d, m, o, s, step=step, extra_state={"data": stream}) == step
    return _snap(m, o, s, stream)


def _diff(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_unmodified_loop_restores_every_step_exactly(tmp_path, strategy):
    m, o, s = _build()
    stream = Stream()
    kw = {"compressor": lowdiff.TopK(0.25), "full_every": 5, "batch_size": 2, "keep_full": None}
    if strategy == "lowdiff+":
        kw = {"compressor": None, "persist_every": 1, "keep_full": None}
    ck = lowdiff.attach(
        m, o, tmp_path / "ck", strategy=strategy, scheduler=s, extra_state={"data": stream}, **kw
    )
    assert isinstance(ck, lowdiff.Checkpointer) and ck.resume() == 0
    snaps = {0: _snap(m, o, s, stream)}
    for step in range(12):
        for _ in range(2):  # gradient accumulation: two batches per update
            x, y = stream.next()
            torch.nn.functional.mse_loss(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        o.step()
        s.step()
        o.zero_grad()
        snaps[step + 1] = _snap(m, o, s, stream)
    assert ck.step_count == 12
    ck.close()
    for step in (12, 11, 7, 5) if strategy == "lowdiff" else (12, 9):
        assert _diff(snaps[step], _restored(tmp_path / "ck", step)) == [], step


def test_attach_and_ck_step_write_the_same_trajectory(tmp_path):
    finals = []
    for mode in ("attach", "step"):
        m, o, s = _build()
        stream = Stream()
        kw = {"compressor": lowdiff.TopK(0.25), "full_every": 4, "batch_size": 3}
        if mode == "attach":
            ck = lowdiff.attach(m, o, tmp_path / mode, scheduler=s, **kw)
        else:
            ck = lowdiff.Checkpointer(m, o, tmp_path / mode, scheduler=s, **kw)
        ck.resume()
        for _ in range(9):
            x, y = stream.next()
            torch.nn.functional.mse_loss(m(x), y).backward()
            if mode == "attach":
                o.step()
                s.step()
            else:
                ck.step()
            o.zero_grad()
        ck.close()
        finals.append(_snap(m, o, s, stream))
    assert _diff(*finals) == []


def test_grad_scaler_skipped_step_makes_no_record_and_its_state_is_restored(tmp_path):
    m, o, s = _build()
    stream = Stream()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ck = lowdiff.attach(
        tmp_path / "ck",
        m,
        o,
        compressor=lowdiff.TopK(0.25),
        full_every=4,
        records_per_file=2,
        keep_full=None,
        scheduler=s,
        extra_state={"data": stream, "scaler": scaler},
    )
    ck.resume()
    snaps, scales, skipped = {}, {}, 0
    for it in range(10):
        x, y = stream.next()
        loss = torch.nn.functional.mse_loss(m(x), y)
        if it == 4:
            loss = loss * float("inf")  # inf gradients: the scaler skips this update
        before = ck.step_count
        scaler.scale(loss).backward()
        scaler.step(o)
        scaler.update()
        if ck.step_count == before:
            skipped += 1
        else:
            s.step()
        o.zero_grad()
        # the state of step n is the one right after update n (before a skipped batch)
        snaps.setdefault(ck.step_count, _snap(m, o, s, stream))
        scales.setdefault(ck.step_count, scaler.state_dict())
    assert skipped == 1 and ck.step_count == 9
    ck.close()
    for step in (9, 5, 4, 3):
        m2, o2, s2 = _build()
        got_stream, got_scaler = Stream(), torch.amp.GradScaler("cpu")
        lowdiff.restore(
            tmp_path / "ck",
            m2,
            o2,
            s2,
            step=step,
            extra_state={"data": got_stream, "scaler": got_scaler},
        )
        assert _diff(snaps[step], _snap(m2, o2, s2, got_stream)) == [], step
        assert got_scaler.state_dict() == scales[step], step


def test_closure_runs_before_the_gradients_are_taken(tmp_path):
    m, o, _ = _build()
    stream = Stream()
    ck = lowdiff.attach(
        tmp_path / "ck", m, o, compressor=lowdiff.TopK(0.25), full_every=3, records_per_file=2
    )
    ck.resume()
    snaps = {}

    def closure():
        o.zero_grad()
        x, y = stream.next()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    for _ in range(5):
        o.step(closure)
        snaps[ck.step_count] = _snap(m, o, None, stream)
    assert ck.step_count == 5
    with pytest.raises(lowdiff.LowDiffError, match="closure .* returned no loss"):
        o.step(lambda: None)
    ck.close()
    m2, o2, _ = _build()
    assert lowdiff.restore(tmp_path / "ck", m2, o2, step=5) == 5
    got = state_tensors(m2, o2)
    assert [k for k in got if not torch.equal(got[k], snaps[5][k])] == []


def test_attach_errors_are_clear(tmp_path):
    m, o, s = _build()
    ck = lowdiff.attach(tmp_path / "a", m, o, scheduler=s, compressor=lowdiff.TopK(ratio=0.01))
    with pytest.raises(RuntimeError, match="already attached"):
        lowdiff.attach(tmp_path / "b", m, o, compressor=lowdiff.TopK(ratio=0.01))
    ck.resume()
    with pytest.raises(RuntimeError, match="attached to the optimizer: call optimizer.step"):
        ck.step()
    ck.close()
    ck = lowdiff.attach(
        tmp_path / "c", m, o, compressor=lowdiff.TopK(ratio=0.01)
    )  # after close() the optimizer is free again
    ck.close()
    with pytest.raises(ValueError, match="attach\\(\\) drives lowdiff's own methods"):
        lowdiff.attach(m, o, tmp_path / "d", strategy="torch-save")
    other = torch.nn.Linear(6, 16)
    with pytest.raises(ValueError, match="not in the model"):
        lowdiff.attach(tmp_path / "e", other, o, compressor=lowdiff.TopK(ratio=0.01))
    with pytest.raises(ValueError, match="max_lag >= 2"):
        lowdiff.attach(
            tmp_path / "f",
            m,
            o,
            method="lowdiff+",
            compressor=None,
            replica=lowdiff.ReplicaOptions(max_lag=1),
        )


def test_attach_unwraps_a_framework_wrapper_and_names_late_extra(tmp_path):
    class Wrapper(torch.optim.Optimizer):  # shaped like Accelerate's AcceleratedOptimizer
        def __init__(self, inner):
            self.optimizer = inner

        @property
        def param_groups(self):
            return self.optimizer.param_groups

        def step(self, closure=None):
            return self.optimizer.step(closure)

    m, o, s = _build()
    ck = lowdiff.attach(
        tmp_path / "ck",
        m,
        Wrapper(o),
        scheduler=s,
        extra_state={"data": Stream()},
        compressor=lowdiff.TopK(ratio=0.01),
    )
    assert ck.optimizer is o  # the hooks are on the optimizer that updates the parameters
    with pytest.raises(ValueError, match="extra_state has no 'nope'"):
        ck.strategy_impl.capture_after_update("nope")
    ck.close()
