"""Distributed building blocks, in one process: shards, merged records, plans, a 1-rank DDP job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff
from lowdiff.compressors import MergedSparse, compressor_from_spec
from lowdiff.compressors.merged import merge_sparse
from lowdiff.ddp import assign_shards
from lowdiff.ddp.shard import merge_state_dicts, shard_state_dict
from lowdiff.errors import RecoveryError
from lowdiff.inspection import inspect_job
from lowdiff.recovery.scan import FileInfo, Scan
from lowdiff.recovery.shards import plan_sharded
from lowdiff.state.capture import diff_states, snapshot_state


def test_assign_shards_is_balanced_and_deterministic():
    numels = [1000, 10, 500, 500, 7, 300, 300, 64]
    owner = assign_shards(numels, 3)
    assert owner == assign_shards(numels, 3)
    assert sorted(set(owner)) == [0, 1, 2]
    loads = [sum(n for n, o in zip(numels, owner, strict=True) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(numels)
    assert assign_shards(numels, 1) == [0] * len(numels)
    with pytest.raises(ValueError):
        assign_shards(numels, 0)


def test_optimizer_state_splits_into_shards_and_back():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(5)]
    opt = torch.optim.AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.1}])
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    full = opt.state_dict()
    shards = [[0, 3], [1, 2, 4]]
    parts = [(shard_state_dict(full, s), s) for s in shards]
    assert parts[0][0]["param_groups"][0]["params"] == [0]  # local numbering
    assert parts[0][0]["param_groups"][1]["params"] == [1]
    # a shard's state dict loads into an optimizer over the shard's parameters alone
    sub = torch.optim.AdamW([{"params": [ps[0]]}, {"params": [ps[3]], "lr": 0.1}])
    sub.load_state_dict(parts[0][0])
    merged = merge_state_dicts(parts, own=1)
    opt2 = torch.optim.AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.1}])
    opt2.load_state_dict(merged)
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i in a["state"]:
        for k, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][k])


def test_merge_sparse_sums_duplicates_in_rank_order_and_averages():
    parts = [
        (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 4, 7])),
        (torch.tensor([10.0, 20.0, 30.0]), torch.tensor([4, 5, 0])),
    ]
    dense = merge_sparse(parts, 8, 2)
    assert torch.equal(dense, torch.tensor([15.5, 0, 0, 0, 6.0, 10.0, 0, 1.5]))
    m = MergedSparse(lowdiff.TopK(3 / 8), world_size=2)
    support = torch.cat([i for _, i in parts])
    payload = m.compress(dense, key=0, step=0, support=support)
    assert int(payload["count"][0]) == 4  # the union {0, 4, 5, 7}
    assert torch.equal(m.decompress(payload, 8, torch.float32), dense)
    assert compressor_from_spec(m.spec()).spec() == m.spec()
    # a forged count is an error, not an out-of-bounds read
    payload["count"][0] = 99
    with pytest.raises(ValueError, match="count"):
        m.decompress(payload, 8, torch.float32)
    with pytest.raises(ValueError, match="sparsifier"):
        MergedSparse(lowdiff.QSGD(), world_size=2)


def _scan(root: str, fulls: list[int], records: list[tuple[int, int]]) -> Scan:
    sc = Scan(Path(root), {})
    sc.fulls = [FileInfo(Path(f"{root}/full-{s}"), "full", s, s, 1, 0) for s in fulls]
    sc.records = [
        FileInfo(Path(f"{root}/rec-{a}-{b}"), "records", a, b, 1, b - a + 1) for a, b in records
    ]
    return sc


def test_shards_agree_on_the_newest_step_all_of_them_serve():
    a = _scan("a", [0, 10], [(0, 4), (5, 9), (10, 14)])
    b = _scan("b", [0, 10], [(0, 4), (5, 9), (10, 11)])
    assert plan_sharded([a, b], None) == (12, 10)
    assert plan_sharded([a, b], 7) == (7, 0)
    # shard b lost its full checkpoint of step 10: both replay from step 0
    b.fulls = b.fulls[:1]
    assert plan_sharded([a, b], None) == (12, 0)
    with pytest.raises(RecoveryError, match="not recoverable in every shard"):
        plan_sharded([a, b], 13)


def _ddp_objects():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, ck, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        ck.step()
        opt.zero_grad()


@pytest.mark.multiprocess
def test_one_rank_ddp_job_resumes_exactly(tmp_path, one_rank_group):
    d = tmp_path / "ck"
    model, opt = _ddp_objects()
    with lowdiff.Checkpointer(
        d, model, opt, compressor=lowdiff.TopK(0.2), full_every=4, records_per_file=2
    ) as ck:
        ck.resume()
        _train(model, opt, ck, 0, 7)
        want = snapshot_state(model, opt)
    assert inspect_job(d).recoverable == (0, 7)
    model2, opt2 = _ddp_objects()
    ck2 = lowdiff.Checkpointer(
        d, model2, opt2, compressor=lowdiff.TopK(0.2), full_every=4, records_per_file=2
    )
    assert ck2.resume() == 7
    assert ck2.recovery_stats is not None and ck2.recovery_stats.records_replayed == 3
    assert diff_states(want, snapshot_state(model2, opt2)) == []
    ck2.close()


def test_ddp_rejects_a_dense_compressor_and_a_second_hook(tmp_path, one_rank_group):
    model, opt = _ddp_objects()
    with pytest.raises(ValueError, match="not a sparsifier"):
        lowdiff.Checkpointer(tmp_path / "a", model, opt, compressor=lowdiff.QSGD())
    ck = lowdiff.Checkpointer(
        tmp_path / "b", model, opt, method="compression-only", compressor=lowdiff.TopK(ratio=0.01)
    )
    with pytest.raises(lowdiff.LowDiffError, match="communication hook"):
        lowdiff.Checkpointer(tmp_path / "c", model, opt, compressor=lowdiff.TopK(ratio=0.01))
    ck.close()


def test_ddp_without_a_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    fake = DDP.__new__(DDP)  # an instance without a group: enough for the check
    torch.nn.Module.__init__(fake)
    fake.module = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(fake.module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="init_process_group"):
        lowdiff.Checkpointer(
            None, fake, opt, method="compression-only", compressor=lowdiff.TopK(ratio=0.01)
        )


def test_record_takes_the_clipped_values_and_refuses_new_entries():
    from lowdiff.ddp.hooks import record_consumed
    from lowdiff.state.capture import ParamInfo

    p = torch.nn.Parameter(torch.zeros(6))
    info = ParamInfo(index=0, name="w", shape=(6,), dtype=torch.float32)
    merged = MergedSparse(lowdiff.TopK(0.5, error_feedback=False), world_size=2)
    dense = merge_sparse(
        [
            (torch.tensor([1.0, 3.0]), torch.tensor([0, 4])),
            (torch.tensor([2.0]), torch.tensor([4])),
        ],
        6,
        2,
    )
    support = torch.tensor([0, 4, 4])
    p.grad = dense.clone()
    payloads = {0: merged.compress(dense, key=0, step=0, support=support)}
    norm = torch.nn.utils.clip_grad_norm_([p], 0.1)
    assert norm > 0.1  # the clip fired
    record_consumed(payloads, [(info, p)])
    assert torch.equal(merged.decompress(payloads[0], 6, torch.float32), p.grad)
    p.grad[2] = 0.5  # an entry the hook did not merge
    with pytest.raises(lowdiff.LowDiffError, match="'w' changed outside"):
        record_consumed(payloads, [(info, p)])
