"""extra_state: state beyond model, optimizer and scheduler travels with every step."""

from __future__ import annotations

import pytest
import torch

import lowdiff
from lowdiff.state.capture import state_tensors


class Stream:
    """A data source with a position (what a StatefulDataLoader checkpoints)."""

    def __init__(self) -> None:
        self.pos = 0
        self.seen = torch.zeros(3, dtype=torch.int64)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.pos)
        self.pos += 1
        self.seen[self.pos % 3] += 1
        return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)

    def state_dict(self) -> dict:
        return {"pos": self.pos, "seen": self.seen.clone(), "tag": ("epoch", 0.5)}

    def load_state_dict(self, sd: dict) -> None:
        assert sd["tag"] == ("epoch", 0.5)
        self.pos, self.seen = int(sd["pos"]), sd["seen"].clone()


def _build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s = torch.optim.lr_scheduler.StepLR(o, 3, 0.5)
    return m, o, s


def _train(ck, m, o, stream, n, grad_accum=1):
    snaps = {}
    for _ in range(n):
        for _ in range(grad_accum):  # several batches per update
            x, y = stream.next()
            torch.nn.functional.mse_loss(m(x), y).backward()
        ck.step()
        o.zero_grad()
        snaps[ck.step_count] = stream.state_dict()
    return snaps


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_extra_state_is_restored_at_every_step(tmp_path, strategy):
    m, o, s = _build()
    stream = Stream()
    kw = {"compressor": None, "persist_every": 1, "keep_full": None}
    if strategy == "lowdiff":
        kw = {"compressor": lowdiff.TopK(0.2), "full_every": 4, "batch_size": 3, "keep_full": None}
    ck = lowdiff.Checkpointer(
        m, o, tmp_path / "ck", strategy=strategy, scheduler=s, extra_state={"data": stream}, **kw
    )
    ck.resume()
    snaps = _train(ck, m, o, stream, 10, grad_accum=2)
    live = state_tensors(m, o, s)
    ck.close()
    for step in (10, 8, 5, 4) if strategy == "lowdiff" else (10, 7):
        m2, o2, s2 = _build()
        got = Stream()
        assert (
            lowdiff.restore(tmp_path / "ck", m2, o2, s2, step=step, extra_state={"data": got})
            == step
        )
        assert got.pos == snaps[step]["pos"] == 2 * step
        assert torch.equal(got.seen, snaps[step]["seen"])
        if step == 10:
            diff = [k for k, v in state_tensors(m2, o2, s2).items() if not torch.equal(v, live[k])]
            assert diff == []

    # resume() restores it too, and training goes on with the next batch
    m3, o3, s3 = _build()
    again = Stream()
    ck = lowdiff.Checkpointer(
        m3, o3, tmp_path / "ck", strategy=strategy, scheduler=s3, extra_state={"data": again}, **kw
    )
    assert ck.resume() == 10
    assert again.pos == 20
    ck.close()


def test_extra_state_errors_are_clear(tmp_path):
    m, o, s = _build()
    with pytest.raises(TypeError, match=r"extra_state\['data'\] \(int\) has no state_dict"):
        lowdiff.Checkpointer(
            tmp_path / "a", m, o, extra_state={"data": 3}, compressor=lowdiff.TopK(ratio=0.01)
        )

    class Bad:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, sd):
            pass

    # each state_dict() is taken once when the Checkpointer is built: nothing is started
    with pytest.raises(TypeError, match=r"extra_state\['bad'\].*cannot be saved without pickling"):
        lowdiff.Checkpointer(
            tmp_path / "b", m, o, extra_state={"bad": Bad()}, compressor=lowdiff.TopK(ratio=0.01)
        )
    assert not (tmp_path / "b").exists()

    ck = lowdiff.Checkpointer(tmp_path / "c", m, o, compressor=lowdiff.TopK(0.5))
    ck.resume()
    x = torch.randn(4, 6)
    m(x).sum().backward()
    ck.step()
    ck.close()
    with pytest.raises(
        lowdiff.CheckpointMismatchError,
        match="'data' was passed, but the checkpoint holds no extra state",
    ):
        lowdiff.restore(tmp_path / "c", *_build()[:2], extra_state={"data": Stream()})
    with pytest.raises(ValueError, match="extra_state is supported by lowdiff's own methods"):
        lowdiff.Checkpointer(
            m, o, tmp_path / "d", strategy="torch-save", extra_state={"x": Stream()}
        )


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])


@pytest.mark.parametrize("recapture", [False, True])
def test_a_counter_changed_after_the_update_under_attach(tmp_path, recapture):
    """README, "When the extra state is taken": under attach a counter the loop changes
    after optimizer.step() is taken before the change (restored a step behind), unless it
    is captured after the update and taken again with recapture() after each change."""
    m, o, s = _build()
    stream, ctr = Stream(), Counter()
    ck = lowdiff.attach(tmp_path, m, o, scheduler=s, compressor=lowdiff.TopK(0.2, error_feedback=False), full_every=4, records_per_file=3, keep_full=None, extra_state={"ctr": ctr})  # fmt: skip
    ck.resume()
    if recapture:
        lowdiff.own_strategy(ck).capture_after_update("ctr")
    for _ in range(9):
        x, y = stream.next()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        s.step()
        o.zero_grad()
        ctr.n += 1  # the loop's own count of updates, changed after optimizer.step()
        if recapture:
            lowdiff.own_strategy(ck).recapture("ctr")
    ck.close()
    for step in (3, 4, 9):
        got = Counter()
        m2, o2, s2 = _build()
        assert lowdiff.restore(tmp_path, m2, o2, s2, step=step, extra_state={"ctr": got}) == step
        assert got.n == (step if recapture else step - 1), (step, got.n)


class LazyStream(Stream):
    """A data source that restores its position only when iterated again (as Lightning's
    fit loop restores its loader's): right after ``load_state_dict`` its ``state_dict``
    is still the fresh one."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict | None = None

    def load_state_dict(self, sd: dict) -> None:
        self.pending = sd

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is not None:
            Stream.load_state_dict(self, self.pending)
            self.pending = None
        return super().next()


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_the_checkpoint_rewritten_at_a_resume_keeps_the_recovered_extra_state(tmp_path, strategy):
    """A resume from disk that persists the recovered step again (LowDiff+ seeds a new
    replica, which persists it) saves the extra state it recovered, not what the objects
    say before they have applied it: a second crash before the next checkpoint would
    otherwise resume with the data position lost."""
    d = tmp_path / "ck"
    m, o, s = _build()
    stream = Stream()
    with lowdiff.Checkpointer(m, o, d, strategy=strategy, scheduler=s, extra_state={"data": stream},
                              full_every=4, keep_full=None) as ck:  # fmt: skip
        ck.resume()
        for _ in range(8):
            x, y = stream.next()
            torch.nn.functional.mse_loss(m(x), y).backward()
            ck.step()
            o.zero_grad()
    saved = stream.state_dict()
    assert saved["pos"] == 8
    from lowdiff.format import layout, sfile

    full8 = layout.full_path(d, 8)
    run_before = sfile.read_header(full8).metadata.get("run_id")
    # the restart: resumed from disk, closed before its first step (a crash there loses
    # nothing more: the directory holds the same state)
    m2, o2, s2 = _build()
    lazy = LazyStream()
    with lowdiff.Checkpointer(m2, o2, d, strategy=strategy, scheduler=s2,
                              extra_state={"data": lazy}, full_every=4, keep_full=None) as ck2:  # fmt: skip
        assert ck2.resume() == 8
        assert lazy.state_dict()["pos"] == 0 and lazy.pending is not None  # not applied yet
    # the condition under test: LowDiff+'s new replica persisted step 8 again (LowDiff
    # writes no full checkpoint at a resume: its file is the first session's)
    rewritten = sfile.read_header(full8).metadata.get("run_id") != run_before
    assert rewritten == (strategy == "lowdiff+")
    m3, o3, s3 = _build()
    again = Stream()
    with lowdiff.Checkpointer(m3, o3, d, strategy=strategy, scheduler=s3,
                              extra_state={"data": again}, full_every=4, keep_full=None) as ck3:  # fmt: skip
        assert ck3.resume() == 8
        assert again.pos == saved["pos"] and torch.equal(again.seen, saved["seen"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_retake_replaces_the_state_of_the_step_waiting_for_its_hand_over(tmp_path, strategy):
    """Under attach a step is handed over when the next update begins. retake() takes an
    entry again for it, replacing what recapture() took, the last call before the
    hand-over winning (a framework's evaluation or log after the step); its record and
    its full checkpoint both save that value."""
    import json

    from lowdiff.format import codec, layout, sfile

    m, o, s = _build()
    stream, ctr = Stream(), Counter()
    kw = {"compressor": None, "persist_every": 1}
    if strategy == "lowdiff":
        kw = {"compressor": lowdiff.TopK(0.2, error_feedback=False), "full_every": 4,
              "batch_size": 3}  # fmt: skip
    ck = lowdiff.attach(m, o, tmp_path, strategy=strategy, scheduler=s, keep_full=None,
                        extra_state={"ctr": ctr}, **kw)  # fmt: skip
    ck.resume()
    own = lowdiff.own_strategy(ck)
    own.capture_after_update("ctr")
    for _ in range(8):
        x, y = stream.next()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        s.step()
        o.zero_grad()
        ctr.n = 100 * ck.step_count
        own.recapture("ctr")  # the step's value after its update ...
        ctr.n += 1
        own.recapture("ctr")  # ... which a later recapture() leaves alone
        ctr.n += 2
        own.retake("ctr")
        ctr.n += 4
        own.retake("ctr")  # the last retake() before the next update wins: 100 * step + 7
    with pytest.raises(ValueError, match="extra_state has no 'nope'"):
        own.retake("nope")
    ck.close()
    for step in (3, 4, 8):
        got = Counter()
        m2, o2, s2 = _build()
        assert lowdiff.restore(tmp_path, m2, o2, s2, step=step, extra_state={"ctr": got}) == step
        assert got.n == 100 * step + 7, (step, got.n)
    # the full checkpoint of a step that waited (LowDiff: every 4 steps; LowDiff+: every
    # step) holds the retaken value as well
    md = sfile.read_header(layout.full_path(tmp_path, 4)).metadata
    assert codec.decode(json.loads(md["extra"])["ctr"]) == {"n": 407}


class _NoState(Counter):
    """What an Accelerate loader prepared without ``use_stateful_dataloader=True`` does:
    ``state_dict()`` raises."""

    def state_dict(self) -> dict:
        return self.dl_state_dict  # type: ignore[attr-defined]


class _NoLoad(Counter):
    def load_state_dict(self, sd: dict) -> None:
        raise KeyError("pos")


def test_a_failing_state_dict_or_load_state_dict_names_the_entry(tmp_path):
    m, o, s = _build()
    want = r"extra_state\['data'\] \(_NoState\): its state_dict\(\) raised AttributeError"
    # at once, when the Checkpointer is built (attach too), before anything is written
    with pytest.raises(lowdiff.LowDiffError, match=want):
        lowdiff.Checkpointer(
            tmp_path / "a",
            m,
            o,
            extra_state={"data": _NoState()},
            compressor=lowdiff.TopK(ratio=0.01),
        )
    with pytest.raises(lowdiff.LowDiffError, match=want):
        lowdiff.attach(
            tmp_path / "a",
            m,
            o,
            extra_state={"data": _NoState()},
            compressor=lowdiff.TopK(ratio=0.01),
        )
    assert not (tmp_path / "a").exists()
    ck = lowdiff.attach(tmp_path / "a", m, o, compressor=None, extra_state={"c": Counter()})
    ck.resume()  # the attach above that failed left the optimizer free
    ck.close()

    d = tmp_path / "b"
    with lowdiff.Checkpointer(d, m, o, compressor=None, extra_state={"c": Counter()}) as ck:
        ck.resume()
        m(torch.randn(4, 6)).sum().backward()
        ck.step()
    want = r"extra_state\['c'\] \(_NoLoad\): its load_state_dict\(\) raised KeyError"
    m2, o2, _ = _build()
    ck = lowdiff.Checkpointer(d, m2, o2, compressor=None, extra_state={"c": _NoLoad()})
    with pytest.raises(lowdiff.LowDiffError, match=want):
        ck.resume()
    ck.close()
    with pytest.raises(lowdiff.LowDiffError, match=want):
        lowdiff.restore(d, m2, o2, extra_state={"c": _NoLoad()})
