"""Units of LowDiff+'s peer copies: placement, the choice of sources after a node loss,
the options, and the links between two replicas (loopback sockets, one process)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

import lowdiff
from lowdiff.ddp.peers import (
    copy_source,
    free_port,
    holder_of,
    memory_sources,
    resolve_peer_copies,
)
from lowdiff.engine.replica.peer import PeerLinks, pack, unpack
from lowdiff.engine.wire.configs import PeerConfig
from lowdiff.errors import UnsupportedSetupError


@pytest.mark.parametrize(("world", "local"), [(2, 1), (4, 2), (6, 2), (8, 4), (3, 1)])
def test_every_shard_is_copied_once_on_another_node(world, local):
    holders = [holder_of(p, world, local) for p in range(world)]
    assert sorted(holders) == list(range(world))  # each rank holds exactly one copy
    for p, h in enumerate(holders):
        assert h // local != p // local  # on another node
        assert copy_source(h, world, local) == p


def test_auto_turns_copies_on_across_nodes_only(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_peer_copies("auto", 1, 4) == 3
    assert resolve_peer_copies("auto", 1, 2) is None  # one node
    assert resolve_peer_copies(False, 1, 4) is None
    with pytest.raises(UnsupportedSetupError, match="several nodes"):
        resolve_peer_copies(True, 1, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_peer_copies("auto", 1, 4) is None
    with pytest.raises(UnsupportedSetupError, match="LOCAL_WORLD_SIZE"):
        resolve_peer_copies(True, 1, 4)


def test_replica_options_check_the_peer_settings():
    assert lowdiff.ReplicaOptions().peer_copies == "auto"
    with pytest.raises(TypeError, match="peer_copies"):
        lowdiff.ReplicaOptions(peer_copies="yes")
    with pytest.raises(TypeError, match="peer_address"):
        lowdiff.ReplicaOptions(peer_address="")


def test_sources_after_a_loss():
    # 2 nodes of 2 ranks: rank r copies rank (r - 2) mod 4; node A (ranks 0, 1) lost
    lost_a = [(-1, -1, -1), (-1, -1, -1), (9, 0, 9), (9, 1, 9)]
    assert memory_sources(lost_a) == (9, [2, 3, 2, 3])
    # nothing lost: every shard from its own replica
    assert memory_sources([(4, 1, 4), (4, 0, 4)]) == (4, [0, 1])
    # a copy one step behind the shards: not at the step the others hold
    assert "rank 1's shard at step 9" in memory_sources([(9, 1, 8), (-1, -1, -1)])
    # the survivors' replicas at different steps
    assert "different steps" in memory_sources([(9, 1, 9), (8, 0, 8), (-1, -1, -1)])
    # two nodes lost: a shard nobody holds
    assert "rank 0" in memory_sources([(-1, -1, -1), (-1, -1, -1), (5, 1, 5)])
    assert "no rank" in memory_sources([(-1, -1, -1), (-1, -1, -1)])


def test_pack_round_trips_every_dtype_and_shape():
    tensors = {
        "rng.torch": torch.randint(0, 255, (5056,), dtype=torch.uint8),
        "model/bn.running_mean": torch.randn(3, 4),
        "model/bn.num_batches_tracked": torch.tensor(7),
        "model/half": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
    }
    back = unpack(pack(tensors))
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k], v)


@contextlib.contextmanager
def _pair(timeout: float = 5.0) -> Iterator[tuple[PeerLinks, PeerLinks, list[int]]]:
    """Two replicas that copy each other's shard, on loopback (closed at the end)."""
    host = "127.0.0.1"
    ports, keys = [free_port(host), free_port(host)], [b"a" * 32, b"b" * 32]
    acks: list[int] = []

    def cfg(me: int) -> PeerConfig:
        other = 1 - me
        return PeerConfig(
            other, [other], {}, {}, (host, ports[me]), keys[me], other,
            (host, ports[other]), keys[other], timeout,
        )  # fmt: skip

    a, b = PeerLinks(cfg(0), acks.append, timeout), PeerLinks(cfg(1), lambda s: None, timeout)
    try:
        yield a, b, acks
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_parts_travel_to_the_holder_and_acks_come_back():
    with _pair() as (a, b, acks):
        state = {"rng.torch": torch.arange(10, dtype=torch.uint8)}
        a.forward("step", 4, state, '{"sched":null}')
        part = b.take_part(4, "step", 10.0, final=False)
        assert part is not None and part.meta == '{"sched":null}'
        assert torch.equal(part.tensors["rng.torch"], state["rng.torch"])
        b.ack(4)
        deadline = time.monotonic() + 10
        while not acks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert acks == [4]
        # a part of another kind is not the one asked for
        a.forward("init", 5, state, {})
        assert b.take_part(5, "step", 0.3, final=False) is None


@pytest.mark.timeout(60)
def test_an_ended_source_stops_a_final_wait_but_not_a_live_one():
    with _pair() as (a, b, _):
        a.forward("step", 3, {}, "{}")
        assert b.take_part(3, "step", 10.0, final=True) is not None
        a.end(3)
        t0 = time.monotonic()
        assert b.take_part(4, "step", 10.0, final=True) is None  # at once: no part comes
        assert time.monotonic() - t0 < 5
        # a replica whose trainer lives waits: the source may be taken over and go on
        a.forward("step", 4, {}, "{}")
        assert b.take_part(4, "step", 10.0, final=False) is not None


@pytest.mark.timeout(60)
def test_a_source_that_is_gone_ends_the_wait():
    with _pair() as (a, b, _):
        a.forward("step", 1, {}, "{}")
        assert b.take_part(1, "step", 10.0, final=False) is not None
        a.close()  # its node is lost: the connection closes
        t0 = time.monotonic()
        assert b.take_part(2, "step", 20.0, final=False) is None
        assert b.source_gone and time.monotonic() - t0 < 10
