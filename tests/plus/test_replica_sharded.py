"""LowDiff+: the replica's sharded update gives the trainer's bits.

- :class:`ShardedOptimizer` against one optimizer over all parameters (Adam, AdamW, SGD
  with momentum; for-loop, foreach and fused kernels; 1, 2 and 3 shards), through
  parameter groups with their own hyperparameters, a parameter whose state appears late,
  and hyperparameters changed between steps: every parameter and state tensor equal.
- The replica built and merged as the checkpointing process does it, published ORPHANED
  and found by :func:`find_live_replica` as a new trainer finds it: the arena and the
  published metadata hold exactly the bare optimizer's state at the published step.
- End to end with ``replica_threads`` 2 and 3: every persisted step equals the trainer.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.engine.replica.optim import ShardedOptimizer, balanced_shards, piece_plan
from lowdiff.format import codec
from lowdiff.proc import holder as rp
from lowdiff.state.capture import diff_states, snapshot_state
from lowdiff_lab.bench.replica import _Harness, bench_shapes, replica_update_bench

KERNELS = [
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
    (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.8, "dampening": 0.1, "weight_decay": 1e-3}),
]
FLAGS = [{"foreach": False}, {"foreach": True}, {"fused": True}]
SHAPES = [(33, 17), (17,), (64, 8), (8,), (5, 3, 2), (1000,), (1,), (70, 300), (9001,)]
"""Two parameters larger than ALIGN elements: with 2 and 3 shards they are cut."""


# ----------------------------------------------------------------------------- shards


def test_piece_plan_tiles_every_parameter_in_aligned_runs():
    numels = [100_000, 10, 50_000, 3, 4096, 4097, 0, 1]
    for n in (1, 2, 3, 5, 16):
        runs = piece_plan(numels, n, 4096)
        assert 1 <= len(runs) <= n
        pieces = [pc for run in runs for pc in run]
        assert [i for i, _, _ in pieces] == sorted(i for i, _, _ in pieces)  # in order
        for i, size in enumerate(numels):
            mine = [(a, b) for j, a, b in pieces if j == i]
            assert mine[0][0] == 0 and mine[-1][1] == size  # covered end to end
            assert all(b == a2 for (_, b), (a2, _) in zip(mine, mine[1:], strict=False))
            assert all(a % 4096 == 0 for a, _ in mine)  # cuts at aligned offsets
            if size <= 4096:
                assert len(mine) == 1
    loads = [sum(b - a for _, a, b in run) for run in piece_plan([1_000_000, 10, 10], 4)]
    assert max(loads) - min(loads) <= 2 * 4096  # one large parameter, shared evenly
    with pytest.raises(ValueError, match="n must be at least 1"):
        piece_plan([1], 0)


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_scaled_sharded_update_equals_scaled_gradients(flags, threads):
    """``step(scale)`` (the trainer's clipping factor) gives the bits of one optimizer
    stepped on the gradients the trainer multiplied by that factor."""
    g = torch.Generator().manual_seed(5)
    shapes = [(30_011,), (64, 8), (12_000,)]
    ref_p = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    rep_p = [nn.Parameter(p.detach().clone(), requires_grad=False) for p in ref_p]
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, **flags)
    for p in ref_p:
        p.grad = torch.randn(p.shape, generator=g)
    ref.step()
    for p, q in zip(rep_p, ref_p, strict=True):
        p.data.copy_(q.detach())
    got = ShardedOptimizer(torch.optim.AdamW, rep_p, _resolved_state_dict(ref), threads)
    try:
        for _ in range(4):
            grads = [torch.randn(s, generator=g) for s in shapes]
            coef = torch.clamp(
                1.0 / (torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in grads])) + 1e-6),
                max=1.0,
            )
            assert coef.item() < 1.0  # the clip fires
            for a, b, gr in zip(ref_p, rep_p, grads, strict=True):
                a.grad = gr.clone()
                b.grad = gr.clone()
            torch._foreach_mul_([p.grad for p in ref_p], coef)
            ref.step()
            got.step(torch.tensor(coef.item(), dtype=coef.dtype))
            _assert_same(ref, got, ref_p, rep_p)
        assert (len(got._cuts) > 0) == (threads > 1)  # the large parameter was shared
    finally:
        got.close()


def test_balanced_shards_cover_every_parameter_once_and_balance():
    numels = [1000, 10, 10, 500, 500, 1, 7]
    for n in (1, 2, 3, 4):
        parts = balanced_shards(numels, n)
        assert sorted(i for p in parts for i in p) == list(range(len(numels)))
        assert all(p == sorted(p) for p in parts)
        assert len(parts) == min(n, len(numels))
    loads = [sum(numels[i] for i in p) for p in balanced_shards(numels, 2)]
    assert max(loads) - min(loads) <= 10
    assert balanced_shards([5, 5], 4) == [[0], [1]]  # no empty shards
    assert balanced_shards([], 3) == []
    with pytest.raises(ValueError, match="n must be at least 1"):
        balanced_shards([1], 0)


# ----------------------------------------------------------------------------- the update


def _groups(params: list[nn.Parameter], hp: dict[str, Any]) -> list[dict[str, Any]]:
    # two groups with their own learning rates, interleaved with the shard boundaries
    return [
        {"params": params[0::2], **hp},
        {"params": params[1::2], **{**hp, "lr": hp["lr"] * 0.5}},
    ]


def _resolved_state_dict(opt: torch.optim.Optimizer) -> dict[str, Any]:
    # what the replica's init message carries, decoded (tensors copied, as in the arena)
    sd = opt.state_dict()
    return {
        "state": {
            k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in s.items()}
            for k, s in sd["state"].items()
        },
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }


def _assert_same(ref: torch.optim.Optimizer, got: ShardedOptimizer, rp_: list, gp: list) -> None:
    for i, (a, b) in enumerate(zip(rp_, gp, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs"
    sa, sb = ref.state_dict(), got.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert list(sa["state"]) == list(sb["state"])  # the order state_dict() lists it in
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys()
        for n, v in sa["state"][k].items():
            w = sb["state"][k][n]
            same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
            assert same, f"state[{k}].{n} differs"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize(
    ("cls", "hp"), KERNELS, ids=["adam-wd", "adamw-amsgrad", "sgd-nesterov", "sgd-damp-wd"]
)
def test_sharded_update_equals_one_optimizer(cls, hp, flags, threads):
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ref_p = [nn.Parameter(t.clone()) for t in init]
    rep_p = [nn.Parameter(t.clone(), requires_grad=False) for t in init]
    ref = cls(_groups(ref_p, {**hp, **flags}))
    # a step before the replica starts: the state comes in through the init message
    for p in ref_p:
        p.grad = torch.randn(p.shape, generator=g)
    ref.step()
    for p, q in zip(rep_p, ref_p, strict=True):
        p.data.copy_(q.detach())
    # the replica's parameters come in the optimizer's order (its state_dict indices)
    in_opt_order = [rep_p[i] for i in range(0, len(SHAPES), 2)] + [
        rep_p[i] for i in range(1, len(SHAPES), 2)
    ]
    got = ShardedOptimizer(cls, in_opt_order, _resolved_state_dict(ref), threads)
    try:
        # a parameter without gradient until step 3: its state appears mid-run (not for
        # fused SGD, which itself fails on a mix of first and later momentum steps)
        late = -1 if (cls is torch.optim.SGD and flags.get("fused")) else len(SHAPES) - 2
        if late >= 0:
            ref.state.pop(ref_p[late], None)
            got.state.pop(rep_p[late], None)
            for shard in got.shards:
                shard.state.pop(rep_p[late], None)
        for step in range(7):
            grads = [torch.randn(s, generator=g) for s in SHAPES]
            for i, (a, b) in enumerate(zip(ref_p, rep_p, strict=True)):
                gi = None if (i == late and step < 3) else grads[i]
                a.grad = gi
                b.grad = None if gi is None else gi.clone()
            if step == 4:  # a scheduler's change, as hp arrives with each record
                for grp in ref.param_groups:
                    grp["lr"] *= 0.3
                got.apply_hparams(
                    [{k: v for k, v in grp.items() if k != "params"} for grp in ref.param_groups]
                )
            ref.step()
            got.step()
            _assert_same(ref, got, ref_p, rep_p)
        assert len(got.shards) == threads
        # the element-wise optimizers share a large parameter between threads
        assert (len(got._cuts) > 0) == (threads > 1)
    finally:
        got.close()


def test_fused_and_foreach_kernels_differ_on_cpu_for_adam():
    """Why the replica runs the trainer's own flags: on the CPU, fused Adam rounds
    differently from the for-loop/foreach kernels (which agree with each other)."""
    out = {}
    for name, flags in (
        ("loop", {"foreach": False}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4096))
        opt = torch.optim.Adam([p], lr=1e-2, **flags)
        for _ in range(4):
            p.grad = torch.randn(4096)
            opt.step()
        out[name] = p.detach()
    assert torch.equal(out["loop"], out["foreach"])
    assert not torch.equal(out["loop"], out["fused"])


# ----------------------------------------------------------------------------- the replica


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("optimizer", "flags"),
    [
        ("torch.optim.AdamW", {"fused": True}),
        ("torch.optim.Adam", {"foreach": True}),
        ("torch.optim.SGD", {"momentum": 0.9}),
    ],
)
def test_orphaned_replica_is_found_at_the_merged_step_with_exact_state(
    optimizer, flags, threads, tmp_path
):
    h = _Harness(optimizer, flags, threads, 20_000, seed=1)
    try:
        for _ in range(5):
            h.merge()
            h.bare_step()
        assert h.identical()
        # running: only the header advances; the step there is the merged one
        state, step, _ = h.rep.ctl.read()
        assert (state, step) == (rp.STATE_RUNNING, h.rep.step)
        h.rep.publish(rp.STATE_ORPHANED)
        root = Path(h.tmp.name)
        rp.write_descriptor(
            root,
            rp.Descriptor(
                os.getpid(),
                socket.gethostname(),
                h.rep.cfg.run_id,
                h.ctl_shm.name,
                h.rep.rl.layout_id,
            ),
        )
        live, why = rp.find_live_replica(root, h.rep.rl.layout_id, wait_s=1.0)
        assert live is not None, why
        try:
            meta = live.doc["meta"]
            assert live.step == int(meta["step"]) == h.rep.step
            tensors = live.tensors()
            for i, q in enumerate(h.bare_params):
                assert torch.equal(tensors[f"model/p{i}"], q), f"parameter {i}"
            osd = codec.loads(meta["optim"], lambda n: tensors[n])
            want = h.bare.state_dict()
            assert osd["param_groups"] == want["param_groups"]
            assert osd["state"].keys() == want["state"].keys()
            for k, s in want["state"].items():
                for n, v in s.items():
                    assert torch.equal(osd["state"][k][n], v), f"state[{k}].{n}"
        finally:
            live.close()
            rp.remove_descriptor(root)
    finally:
        h.close()


def test_replica_bench_reports_ratio_and_same_bits():
    rows = replica_update_bench(
        n_params=20_000,
        threads=(1, 2),
        kernels=(("torch.optim.AdamW", {"fused": True}),),
        repeats=2,
        steps=2,
    )
    assert [r["threads"] for r in rows] == [1, 2]
    for r in rows:
        assert r["identical"]
        assert r["replica_s"] > 0 and r["bare_s"] > 0
        assert r["target"] == 1.2 and r["ratio"] == pytest.approx(r["replica_s"] / r["bare_s"])
        assert set(r["stage_s"]) == {"bind", "optimizer", "hand_back"} and r["copy_in_s"] > 0


def test_replica_bench_with_clipping_keeps_the_bits():
    """With ``clip=True`` the replica multiplies its copies by the factor and the bare
    twin its gradients: both sides hold the same bits after the same steps."""
    rows = replica_update_bench(
        n_params=60_000,
        threads=(2,),
        kernels=(("torch.optim.AdamW", {"fused": True}), ("torch.optim.Adam", {"foreach": True})),
        repeats=2,
        steps=2,
        clip=True,
    )
    assert [r["clip"] for r in rows] == [True, True]
    assert all(r["identical"] for r in rows)
    assert bench_shapes(0, "gpt2-117m") and sum(
        torch.Size(s).numel() for s in bench_shapes(0, "gpt2-117m")
    ) == 117_811_200  # the parameters of the 117.8M GPT-2 of benchmarks/gpu_reference.py


# ----------------------------------------------------------------------------- end to end


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.bn(self.a(x))))))


@pytest.mark.multiprocess
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    ],
    ids=["adamw-fused", "adam-foreach", "sgd-momentum"],
)
def test_every_persisted_step_equals_the_trainer_with_replica_threads(tmp_path, make, threads):
    steps = 6

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        m = _Net()
        o = make(m.parameters())
        return m, o, torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)

    model, opt, sched = build()
    d = tmp_path / "ck"
    ck = lowdiff.Checkpointer(
        d,
        model,
        opt,
        method="lowdiff+",
        scheduler=sched,
        keep_full=None,
        replica=lowdiff.ReplicaOptions(persist_every=1, threads=threads),
    )
    snaps = {}
    try:
        assert ck.resume() == 0
        snaps[0] = snapshot_state(model, opt, sched)
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            ((model(x) - y) ** 2).mean().backward()
            ck.step()
            opt.zero_grad()
            snaps[step + 1] = snapshot_state(model, opt, sched)
    finally:
        ck.close()
    assert ck.durable_step == steps
    for step, want in snaps.items():
        m, o, s = build()
        assert lowdiff.restore(d, m, o, s, step=step) == step
        bad = diff_states(want, snapshot_state(m, o, s))
        assert not bad, f"step {step} differs in {bad[:8]}"
