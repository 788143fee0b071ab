"""The per-step capture helpers give exactly what the plain captures give, and notice
every change; the pipeline's stage timings add up."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
import torch

import lowdiff
from lowdiff.format import codec
from lowdiff.state import capture as st
from lowdiff.state import rng
from lowdiff.strategy import PIPELINE_STAGES, trainer_overhead_s


def _opt(**kw):
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.Adam([{"params": [p]}, {"params": [q], "lr": 0.5}], lr=0.1, **kw)


def _plain(opt) -> str:
    return codec.dumps(st.capture_hparams(opt))


def test_hparams_text_equals_the_plain_encoding_and_sees_every_change():
    opt = _opt()
    h = st.HparamsText()
    assert h(opt) == _plain(opt)
    assert h(opt) == _plain(opt)  # memoised
    opt.param_groups[1]["lr"] = 0.25  # a scheduler's assignment
    assert h(opt) == _plain(opt) and '"lr":0.25' in h(opt)
    opt.param_groups[0]["betas"] = (0.8, 0.9)
    assert h(opt) == _plain(opt)
    opt.param_groups[0]["new_key"] = 3  # a key added
    assert h(opt) == _plain(opt) and "new_key" in h(opt)
    del opt.param_groups[0]["new_key"]
    assert h(opt) == _plain(opt)
    # an int and a float that compare equal are different values to restore
    opt.param_groups[1]["lr"] = 1
    first = h(opt)
    opt.param_groups[1]["lr"] = 1.0
    assert h(opt) == _plain(opt) != first
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.01})
    assert h(opt) == _plain(opt)


def test_hparams_text_re_encodes_mutable_values_every_time():
    opt = _opt()
    h = st.HparamsText()
    opt.param_groups[0]["lr"] = torch.tensor(0.1)  # capturable optimizers hold tensors
    assert h(opt) == _plain(opt)
    opt.param_groups[0]["lr"].fill_(0.3)  # changed in place: same object
    assert h(opt) == _plain(opt)
    opt.param_groups[0]["milestones"] = [1, 2]
    assert h(opt) == _plain(opt)
    opt.param_groups[0]["milestones"].append(3)
    assert h(opt) == _plain(opt) and "[1,2,3]" in h(opt)


def _views(layout: st.RngLayout) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(s, dtype=d) for k, d, s in layout.specs()}


def _rngs() -> tuple[Any, Any]:
    return random.getstate(), np.random.get_state()


def _py_cache(before, after):
    return before[0][2] is None and after[0][2] is not None


def _py_taken(before, after):
    return before[0][2] is not None and after[0][2] is None


def _np_cache(before, after):
    return before[1][3] == 0 and after[1][3] == 1


def _np_taken(before, after):
    return before[1][3] == 1 and after[1][3] == 0


def _any(before, after):
    return True


# (what, the draw, whether what it names happened: judged on the states before and after)
_DRAWS = [
    ("nothing", lambda: None, _any),
    ("random.random", random.random, lambda b, a: a[0][1][-1] != b[0][1][-1]),
    ("random.gauss (a Gaussian cached)", lambda: random.gauss(0.0, 1.0), _py_cache),
    ("random.gauss (the cache taken)", lambda: random.gauss(0.0, 1.0), _py_taken),
    (
        "random's words turn over",
        lambda: random.getrandbits(32 * 700),
        lambda b, a: a[0][1][:624] != b[0][1][:624],
    ),
    ("random.seed", lambda: random.seed(7), _any),
    ("np.random.rand", np.random.rand, lambda b, a: a[1][2] != b[1][2]),
    ("np.random.standard_normal (a Gaussian cached)", np.random.standard_normal, _np_cache),
    ("np.random.standard_normal (the cache taken)", np.random.standard_normal, _np_taken),
    (
        "np.random's key turns over",
        lambda: np.random.randint(0, 9, size=700),
        lambda b, a: not np.array_equal(a[1][1], b[1][1]),
    ),
    (
        "np.random.set_state with a cached Gaussian",
        lambda: np.random.set_state(("MT19937", np.arange(624, dtype=np.uint32), 5, 1, 0.25)),
        lambda b, a: a[1][2:] == (5, 1, 0.25),
    ),
    ("np.random.seed", lambda: np.random.seed(8), lambda b, a: a[1][3] == 0),
    ("torch.rand", lambda: torch.rand(2), _any),
    ("every generator", lambda: (random.random(), np.random.rand(), torch.rand(1)), _any),
]


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "public-api"])
def test_rng_capture_writes_what_capture_rng_returns(in_place):
    layout = st.RngLayout()
    cap = st.RngCapture(layout, in_place=in_place)
    # CPython and NumPy's MT19937: the in-place reads are located (or the test is moot)
    assert (cap.python is not None, cap.numpy is not None) == (in_place, in_place)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    for what, draw, happened in _DRAWS * 2:  # twice: every change seen from every state
        before = _rngs()
        draw()
        assert happened(before, _rngs()), what  # the draw did change what it names
        views = _views(layout)
        extra = cap.into(views)
        tensors, ref_extra = st.capture_rng(layout)
        assert extra == ref_extra, what
        assert tensors.keys() == views.keys()
        for k, v in tensors.items():
            assert v.dtype == views[k].dtype and v.shape == views[k].shape, k
            assert torch.equal(v.view(torch.uint8), views[k].view(torch.uint8)), (k, what)
    # the restored state draws what the captured one would, a cached Gaussian included
    np.random.standard_normal()
    random.gauss(0.0, 1.0)
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1
    views = _views(layout)
    extra = cap.into(views)
    want = (random.gauss(0.0, 1.0), float(np.random.standard_normal()), torch.rand(1))
    random.random(), np.random.rand(), torch.rand(3)
    st.restore_rng(views, extra)
    assert (random.gauss(0.0, 1.0), float(np.random.standard_normal())) == want[:2]
    assert torch.equal(torch.rand(1), want[2])


def test_locating_the_rng_states_leaves_them_as_they_were(monkeypatch):
    monkeypatch.setattr(rng, "_LOCATED", {})  # located afresh, not taken from an earlier test
    random.seed(3)
    np.random.seed(3)
    random.gauss(0.0, 1.0)
    np.random.standard_normal()  # both with a cached Gaussian
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1
    before = (random.getstate(), np.random.get_state())
    cap = st.RngCapture(st.RngLayout())
    assert cap.python is not None and cap.numpy is not None
    after = (random.getstate(), np.random.get_state())
    assert after[0] == before[0]
    assert after[1][0] == before[1][0] and after[1][2:] == before[1][2:]
    assert np.array_equal(after[1][1], before[1][1])


def test_rng_states_that_cannot_be_located_are_read_through_the_public_api(monkeypatch):
    def nowhere(obj, words, what):
        raise LookupError(f"the state words of {what} were not found in place")

    monkeypatch.setattr(rng, "_LOCATED", {})
    monkeypatch.setattr(rng, "_located", nowhere)
    layout = st.RngLayout()
    cap = st.RngCapture(layout)
    assert cap.python is None and cap.numpy is None
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    views = _views(layout)
    tensors, want = st.capture_rng(layout)
    assert cap.into(views) == want
    for k, v in tensors.items():
        assert torch.equal(v.view(torch.uint8), views[k].view(torch.uint8)), k


def test_rng_capture_follows_a_replaced_numpy_bit_generator():
    layout = st.RngLayout()
    cap = st.RngCapture(layout)
    assert cap.numpy is not None and cap.numpy.usable()
    rs = np.random.get_state.__self__
    old = rs._bit_generator
    try:
        np.random.set_bit_generator(np.random.MT19937(5))
        assert not cap.numpy.usable()  # the located generator no longer the one drawn from
        views = _views(layout)
        extra = cap.into(views)
        tensors, ref_extra = st.capture_rng(layout)
        assert extra == ref_extra
        assert torch.equal(
            tensors["rng.numpy"].view(torch.int32), views["rng.numpy"].view(torch.int32)
        )
    finally:
        np.random.set_bit_generator(old)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def test_buffer_refs_follow_reassigned_buffers():
    net = _Net()
    names = st.buffer_names(net)
    refs = st.BufferRefs(net, names)
    assert [t.data_ptr() for t in refs.tensors()] == [
        t.data_ptr() for t in st.get_buffers(net, names).values()
    ]
    net.bn.running_mean = torch.full((4,), 7.0)  # a new tensor in place of the old
    net.count = torch.tensor(5)
    got = dict(zip(names, refs.tensors(), strict=True))
    assert torch.equal(got["bn.running_mean"], torch.full((4,), 7.0))
    assert int(got["count"]) == 5


def test_records_still_replay_exactly_with_changing_hparams_and_buffers(tmp_path):
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ck = lowdiff.Checkpointer(tmp_path / "ck", net, opt, compressor=lowdiff.TopK(0.5), scheduler=sched, full_every=100, records_per_file=2)  # fmt: skip
    ck.resume()
    for i in range(7):
        x = torch.randn(8, 4)
        net.lin(net.bn(x)).pow(2).mean().backward()
        if i == 3:
            opt.param_groups[0]["weight_decay"] = 0.5  # by hand, between steps
            net.count = net.count + 10  # a buffer reassigned
        random.random()
        ck.step()
        opt.zero_grad()
    live = st.state_tensors(net, opt, sched)
    ck.close()
    # the changes happened, and only the records carry them (the one full checkpoint is step 0)
    assert int(net.count) == 10 and opt.param_groups[0]["weight_decay"] == 0.5
    net2 = _Net()
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    assert lowdiff.restore(tmp_path / "ck", net2, opt2, scheduler=sched2) == 7
    assert int(net2.count) == 10 and opt2.param_groups[0]["weight_decay"] == 0.5
    got = st.state_tensors(net2, opt2, sched2)
    assert got.keys() == live.keys()
    for k in live:
        if k.startswith("rng."):
            continue  # restore() into another process's objects leaves the RNG alone
        assert torch.equal(got[k], live[k]), k


@pytest.mark.parametrize("strategy", ["none", "lowdiff"])
def test_pipeline_stage_times_add_up(tmp_path, strategy):
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 16)
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    ck = lowdiff.Checkpointer(
        m, o, tmp_path / "ck", strategy=strategy, compressor=lowdiff.TopK(0.25)
    )
    ck.resume()
    for _ in range(5):
        m(torch.randn(4, 16)).sum().backward()
        ck.step()
        o.zero_grad()
    times = dict(ck.strategy_impl.pipeline_s)
    ck.close()
    assert set(times) == set(PIPELINE_STAGES)
    assert times["steps"] == 5
    assert 0 < times["compress"] <= times["take_gradients"]
    assert times["update"] > 0 and times["after_update"] > 0
    own = trainer_overhead_s(times)
    assert own == pytest.approx(
        times["begin"] + times["take_gradients"] - times["compress"] + times["hparams"]
        + times["after_update"]
    )  # fmt: skip


def test_attach_times_the_same_stages(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    ck = lowdiff.attach(tmp_path / "ck", m, o, compressor=lowdiff.TopK(0.5))
    ck.resume()
    for _ in range(3):
        m(torch.randn(2, 8)).sum().backward()
        o.step()
        o.zero_grad()
    ck.flush()
    times = dict(ck.strategy_impl.pipeline_s)
    ck.close()
    assert times["steps"] == 3 and times["compress"] > 0


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_checkpointing_process_runs_at_a_lower_priority(tmp_path, strategy):
    """A hand-over must not make the checkpointing process (LowDiff's writer, LowDiff+'s
    replica) preempt the trainer: it runs WORKER_NICE below the trainer's priority (the
    trainer's own is untouched)."""
    import os

    from lowdiff.proc.spawn import WORKER_NICE

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    kw: dict[str, Any] = {"compressor": lowdiff.TopK(ratio=0.5)} if strategy == "lowdiff" else {}
    ck = lowdiff.Checkpointer(model, opt, tmp_path, strategy=strategy, **kw)
    try:
        ck.resume()
        model(torch.randn(3, 4)).sum().backward()
        ck.step()
        assert ck.flush() == 1  # the process started up and serves
        pid = ck.strategy_impl.worker_process.pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + WORKER_NICE)
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    finally:
        ck.close()


@pytest.mark.parametrize(
    "compressor",
    [lowdiff.TopK(ratio=0.3), lowdiff.RandomK(ratio=0.3, seed=1), lowdiff.QSGD(bucket_size=8)],
    ids=["topk", "randomk", "qsgd"],
)
def test_payload_runs_write_what_a_copy_per_field_writes(compressor):
    """Record payloads are written run by run (fields end to end with one dtype, one
    concatenation each); the row must hold exactly what a copy per field writes, also
    when a parameter has no payload this step, and a wrong-sized payload is an error."""
    from lowdiff.engine.trainer.slots import RecordSlots, _SlotDsts
    from lowdiff.state.record import RecordLayout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = st.optimizer_params(model, opt)
    layout = RecordLayout.build([i for i, _ in params], compressor, [], st.RngLayout())
    rows = torch.zeros((2, layout.row_bytes), dtype=torch.uint8)
    dsts = [_SlotDsts.of(layout, layout.views(rows[i])) for i in range(2)]
    assert dsts[0].runs and all(len(r.keys) >= 2 for r in dsts[0].runs)
    payloads = {}
    for k, (info, _) in enumerate(params):
        fields = layout.payload(layout.views(rows[0]), k)
        payloads[info.index] = {
            n: (torch.randn(v.shape) * 100).to(v.dtype) if v.is_floating_point()
            else torch.randint(0, 100, v.shape).to(v.dtype)
            for n, v in fields.items()
        }  # fmt: skip

    class Host:  # the attribute _copy_payloads reads
        pass

    Host.dsts = dsts  # type: ignore[attr-defined]

    def by_runs(slot, pl):
        RecordSlots._copy_payloads(Host, slot, pl)  # type: ignore[arg-type]

    def per_field(row, pl):
        for index, fields in pl.items():
            k = next(k for k, (i, _) in enumerate(params) if i.index == index)
            for n, t in fields.items():
                layout.payload(layout.views(row), k)[n].copy_(t)

    for missing in (None, params[1][0].index):
        pl = {i: f for i, f in payloads.items() if i != missing}
        # without the parameter, the runs holding its fields fall back to a copy per field
        assert any(r.gather(pl) is None for r in dsts[0].runs) == (missing is not None)
        rows.zero_()
        by_runs(0, pl)
        per_field(rows[1], pl)
        assert torch.equal(rows[0], rows[1]), missing
    bad = {i: dict(f) for i, f in payloads.items()}
    name = next(iter(bad[params[0][0].index]))
    bad[params[0][0].index][name] = torch.cat([bad[params[0][0].index][name]] * 2)
    with pytest.raises(RuntimeError):
        by_runs(0, bad)


def test_numpy_state_is_read_under_its_generators_lock():
    layout = st.RngLayout()
    cap = st.RngCapture(layout)
    assert cap.numpy is not None
    lock = rng._bound_to(np.random.get_state)._bit_generator.lock
    views = _views(layout)
    done = threading.Event()
    reader = threading.Thread(target=lambda: (cap.into(views), done.set()))
    with lock:  # as a NumPy draw on another thread holds it, without the GIL
        reader.start()
        assert not done.wait(0.2)  # the capture waits for the draw to end
    assert done.wait(10)
    reader.join()
    tensors, want = st.capture_rng(layout)
    assert cap.into(views) == want
