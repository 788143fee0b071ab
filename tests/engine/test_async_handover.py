"""Hand-overs that wait for their device-to-host copy (lowdiff.engine.trainer.pending):
the order of the sends, the bound on the steps waiting, the sends at flush and close,
``ck.acknowledged_step``; on CUDA, a step that returns while its record's copy runs."""

from __future__ import annotations

import warnings

import pytest
import torch

import lowdiff
from lowdiff.engine.trainer.pending import MAX_LAG, PendingSends
from lowdiff.engine.trainer.progress import Progress
from lowdiff.engine.trainer.slots import RecordSlots
from lowdiff.engine.trainer.staging import FullStager
from lowdiff.state.capture import state_tensors


class FakeEvent:
    """A copy's event: pending until ``finish()`` or ``synchronize()``."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.syncs = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True

    def finish(self) -> None:
        self.done = True


def _pending() -> tuple[PendingSends, Progress, list[str]]:
    copies = PendingSends()
    copies.progress = progress = Progress(None)
    return copies, progress, []


# --------------------------------------------------------------------------- the queue


def test_a_send_without_a_copy_goes_at_once():
    copies, progress, sent = _pending()
    copies.submit(1, None, lambda: sent.append("r1"))
    assert sent == ["r1"] and len(copies) == 0 and progress.acknowledged == 1


def test_sends_wait_for_their_copy_and_keep_their_order():
    copies, progress, sent = _pending()
    e1 = FakeEvent()
    copies.submit(1, e1, lambda: sent.append("r1"))
    copies.submit(1, None, lambda: sent.append("f1"))  # a full checkpoint of the same step
    assert sent == [] and len(copies) == 2  # the full waits behind the record
    copies.poll()
    assert sent == [] and progress.acknowledged == -1
    e1.finish()
    copies.poll()
    assert sent == ["r1", "f1"] and progress.acknowledged == 1
    assert e1.syncs == 0  # a completed copy is not waited for
    copies.poll()
    copies.send_all()
    assert sent == ["r1", "f1"]  # nothing twice


def test_a_later_copy_that_ended_waits_for_an_earlier_one():
    copies, _, sent = _pending()
    e1, e2 = FakeEvent(), FakeEvent(done=True)
    copies.submit(1, e1, lambda: sent.append("r1"))
    copies.submit(1, e2, lambda: sent.append("f1"))
    assert sent == []
    e1.finish()
    copies.poll()
    assert sent == ["r1", "f1"]


def test_the_bound_waits_for_the_oldest_step():
    assert MAX_LAG == 1
    copies, progress, sent = _pending()
    events = [FakeEvent() for _ in range(4)]
    copies.submit(1, events[0], lambda: sent.append("r1"))
    copies.submit(1, events[1], lambda: sent.append("f1"))
    assert sent == [] and [e.syncs for e in events] == [0, 0, 0, 0]
    copies.submit(2, events[2], lambda: sent.append("r2"))
    # step 1 is MAX_LAG steps behind: waited for, oldest first; step 2 still waits
    assert sent == ["r1", "f1"] and [e.syncs for e in events] == [1, 1, 0, 0]
    assert progress.acknowledged == 1 and len(copies) == 1
    assert progress.stats["ack_wait_s"] >= 0.0
    copies.submit(3, events[3], lambda: sent.append("r3"))
    assert sent == ["r1", "f1", "r2"] and [e.syncs for e in events] == [1, 1, 1, 0]
    assert progress.acknowledged == 2


def test_send_all_sends_everything_once_in_order():
    copies, progress, sent = _pending()
    e1, e2 = FakeEvent(), FakeEvent()
    copies.submit(1, e1, lambda: sent.append("r1"))
    copies.submit(1, e2, lambda: sent.append("f1"))
    stats_before = progress.stats["ack_wait_s"]
    copies.send_all()
    assert sent == ["r1", "f1"] and (e1.syncs, e2.syncs) == (1, 1)
    assert progress.stats["ack_wait_s"] == stats_before  # a flush is not the bound's wait
    copies.send_all()
    copies.poll()
    assert sent == ["r1", "f1"] and progress.acknowledged == 1


def test_discard_drops_what_waits():
    copies, progress, sent = _pending()
    copies.submit(1, FakeEvent(), lambda: sent.append("r1"))
    copies.discard()
    copies.send_all()
    assert sent == [] and len(copies) == 0 and progress.acknowledged == -1


def test_a_failed_send_is_not_sent_again():
    copies, _, sent = _pending()
    e1 = FakeEvent(done=True)

    def fail() -> None:
        raise OSError("gone")

    copies.submit(1, FakeEvent(), fail)
    copies.submit(1, e1, lambda: sent.append("f1"))
    with pytest.raises(OSError):
        copies.send_all()
    copies.send_all()
    assert sent == ["f1"]


# --------------------------------------------------------------------------- a session (CPU)


def _build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _train_step(m: torch.nn.Module, ck: lowdiff.Checkpointer, o: torch.optim.Optimizer, i: int):
    g = torch.Generator().manual_seed(i)
    m(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
    ck.step()
    o.zero_grad()


def test_cpu_acknowledged_step_is_the_step_count(tmp_path):
    m, o = _build()
    with lowdiff.Checkpointer(tmp_path / "ck", m, o, compressor=lowdiff.TopK(ratio=0.1)) as ck:
        ck.resume()
        assert ck.acknowledged_step == 0  # the first full checkpoint
        for i in range(5):
            _train_step(m, ck, o, i)
            assert ck.acknowledged_step == ck.step_count == i + 1
        assert ck.flush() == 5
        assert ck.durable_step == ck.acknowledged_step == 5
        assert ck.stats["ack_wait_s"] == 0.0


def test_cpu_acknowledged_step_without_checkpoints_is_minus_one(tmp_path):
    m, o = _build()
    ck = lowdiff.Checkpointer(
        None, m, o, method="compression-only", compressor=lowdiff.TopK(ratio=0.1)
    )
    with ck:
        ck.resume()
        _train_step(m, ck, o, 0)
        assert ck.acknowledged_step == ck.durable_step == -1


@pytest.fixture
def pending_copies(monkeypatch):
    """Record copies that end only when waited for: on the CPU, each record's send then
    waits in the queue as it does behind a GPU's copy (the copy itself is synchronous)."""
    events: list[FakeEvent] = []
    fill = RecordSlots.fill_payloads

    def fill_later(self, slot, payloads):
        assert fill(self, slot, payloads) is None
        dst = self.dsts[slot]
        if dst.buffers:  # the device copies them with the payloads
            torch._foreach_copy_(dst.buffers, self.objects.buffer_refs.tensors())
        events.append(FakeEvent())
        return events[-1]

    monkeypatch.setattr(RecordSlots, "fill_payloads", fill_later)
    copy = FullStager._copy

    def copy_later(self, dsts, srcs):
        assert copy(self, dsts, srcs) is None
        events.append(FakeEvent())
        return events[-1]

    monkeypatch.setattr(FullStager, "_copy", copy_later)
    return events


@pytest.mark.multiprocess
def test_sends_after_copies_keep_every_step(tmp_path, pending_copies):
    m, o = _build()
    live = {}
    with lowdiff.Checkpointer(
        tmp_path / "ck", m, o, compressor=lowdiff.TopK(ratio=0.1), full_every=2,
        records_per_file=2,
    ) as ck:  # fmt: skip
        ck.resume()
        for i in range(5):
            _train_step(m, ck, o, i)
            live[i + 1] = {k: v.clone() for k, v in state_tensors(m, o).items()}
            # the step's copy has not ended: one step behind, never more
            if ck.step_count % 2:
                assert ck.acknowledged_step == ck.step_count - MAX_LAG
            else:  # a full checkpoint may need the staging buffer back: all sent first
                assert ck.step_count - MAX_LAG <= ck.acknowledged_step <= ck.step_count
        # each copy was waited for once, the last step's not yet
        assert [e.syncs for e in pending_copies] == [1] * (len(pending_copies) - 1) + [0]
        assert ck.flush() == 5
        assert ck.durable_step == ck.acknowledged_step == 5
        assert all(e.done for e in pending_copies)
    for s in (2, 3, 5):
        m2, o2 = _build(seed=1)
        assert lowdiff.restore(tmp_path / "ck", m2, o2, step=s) == s
        got = state_tensors(m2, o2)
        assert [k for k in live[s] if not torch.equal(live[s][k], got[k])] == []


@pytest.mark.multiprocess
def test_one_record_slot_does_not_wait_for_an_unsent_record(tmp_path, pending_copies):
    m, o = _build()
    with lowdiff.Checkpointer(
        tmp_path / "ck", m, o, compressor=lowdiff.TopK(ratio=0.1), max_inflight=1,
        timeouts=lowdiff.Timeouts(stall=20.0),
    ) as ck:  # fmt: skip
        ck.resume()
        for i in range(4):
            _train_step(m, ck, o, i)
        assert ck.flush() == 4 == ck.acknowledged_step


@pytest.mark.multiprocess
def test_attached_steps_are_sent_after_their_copies(tmp_path, pending_copies):
    m, o = _build()
    ck = lowdiff.attach(tmp_path / "ck", m, o, compressor=lowdiff.TopK(ratio=0.1))
    with ck:
        ck.resume()
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            m(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
            o.step()
            o.zero_grad()
            # handed over when the next update begins, then sent after its copy
            assert ck.step_count - 1 - MAX_LAG <= ck.acknowledged_step <= ck.step_count - 1
        assert ck.flush() == 4 == ck.acknowledged_step


# --------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_SLEEP_CYCLES = 200_000_000
"""GPU clock cycles queued before each ck.step() (about 0.1 s): the step's update, and
the copy after it, cannot have run when ck.step() returns."""


def _cuda_build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.BatchNorm1d(128),  # buffers a forward pass changes
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    ).cuda()
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)


def _cuda_steps(tmp_path, full_every: int, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """Train ``steps`` steps with the GPU busy before each ck.step(); the live state
    after each step."""
    m, o = _cuda_build()
    live = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ck = lowdiff.Checkpointer(
            tmp_path / "ck", m, o, compressor=lowdiff.TopK(ratio=0.1), full_every=full_every
        )
        with ck:
            ck.resume()
            for i in range(steps):
                g = torch.Generator(device="cuda").manual_seed(i)
                m(torch.randn(32, 64, device="cuda", generator=g)).pow(2).mean().backward()
                before = ck.step_count
                torch.cuda._sleep(_SLEEP_CYCLES)
                ck.step()
                o.zero_grad()
                live[i + 1] = {k: v.clone() for k, v in state_tensors(m, o).items()}
                assert ck.acknowledged_step >= before
                if i >= 1 and ck.step_count % full_every != 0:
                    # returned while its copy was in flight (the first step waited for the
                    # process to start; a full checkpoint may wait for the staging buffer)
                    assert ck.acknowledged_step == ck.step_count - 1 == before
            assert ck.stats["slots_pinned"] == 1.0
            assert ck.flush() == steps
            assert ck.acknowledged_step == ck.durable_step == steps
    assert [str(w.message) for w in said if "page-lock" in str(w.message)] == []
    return live


def _assert_restores(tmp_path, live: dict[int, dict[str, torch.Tensor]], steps) -> None:
    for s in steps:
        m2, o2 = _cuda_build(seed=1)
        assert lowdiff.restore(tmp_path / "ck", m2, o2, step=s) == s
        got = state_tensors(m2, o2)
        assert [k for k in live[s] if not torch.equal(live[s][k], got[k])] == []


@pytest.mark.gpu
@pytest.mark.multiprocess
@needs_cuda
def test_cuda_step_returns_before_the_record_copy_and_replays_exactly(tmp_path):
    live = _cuda_steps(tmp_path, full_every=100, steps=6)
    _assert_restores(tmp_path, live, (3, 6))


@pytest.mark.gpu
@pytest.mark.multiprocess
@needs_cuda
def test_cuda_full_checkpoint_copied_while_training_goes_on(tmp_path):
    live = _cuda_steps(tmp_path, full_every=2, steps=5)
    _assert_restores(tmp_path, live, (2, 4))  # a full checkpoint's own step: no replay
