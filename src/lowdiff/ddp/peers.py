"""Where LowDiff+ keeps the peer copy of each rank's shard: on another node.

In a job across nodes (DDP or ``fully_shard``), rank ``r``'s replica also holds a copy
of the shard of rank ``(r - L) mod W`` (``L`` ranks per node, ``W`` in all), so the copy of rank ``p``'s shard
lives on rank ``(p + L) mod W``: the same local rank on the next node, every rank holding
exactly one copy (the load balanced, as Gemini places its replicas). Ranks are numbered
node by node, as ``torchrun`` does (``RANK = node * LOCAL_WORLD_SIZE + LOCAL_RANK``).

Example:
    >>> [copy_source(r, 4, 2) for r in range(4)]
    [2, 3, 0, 1]
    >>> [holder_of(p, 4, 2) for p in range(4)]
    [2, 3, 0, 1]
"""

from __future__ import annotations

import contextlib
import os
import socket

from lowdiff.errors import UnsupportedSetupError


def copy_source(rank: int, world_size: int, local_world_size: int) -> int:
    """The rank whose shard rank ``rank`` keeps a copy of."""
    return (rank - local_world_size) % world_size


def holder_of(rank: int, world_size: int, local_world_size: int) -> int:
    """The rank that keeps the copy of rank ``rank``'s shard."""
    return (rank + local_world_size) % world_size


def local_world_size() -> int | None:
    """Ranks per node, as the launcher says (``LOCAL_WORLD_SIZE``), or None."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def resolve_peer_copies(setting: bool | str, rank: int, world_size: int) -> int | None:
    """The rank whose shard this rank copies, or None: no peer copies.

    ``"auto"`` turns them on when the job (DDP or ``fully_shard``) spans several nodes;
    ``True`` asks for them and is refused where they cannot apply.
    """
    if setting is False:
        return None
    want = setting is True
    local = local_world_size()
    why = ""
    if world_size < 2:
        why = "the job has one rank"
    elif local is None:
        why = "LOCAL_WORLD_SIZE is not set (start the job with torchrun)"
    elif world_size % local or world_size == local:
        why = (
            f"the job does not span several nodes of LOCAL_WORLD_SIZE={local} ranks each "
            f"(WORLD_SIZE={world_size})"
        )
    if why:
        if want:
            raise UnsupportedSetupError(f"ReplicaOptions(peer_copies=True): {why}")
        return None
    assert local is not None
    return copy_source(rank, world_size, local)


def peer_host(configured: str | None) -> str:
    """The address this node's replicas listen on for their peers: ``configured``
    (``ReplicaOptions.peer_address``), else ``LOWDIFF_PEER_ADDR``, else this host's
    address on the route to the job's ``MASTER_ADDR`` (the interface the job's own
    traffic takes), else the host's name."""
    if configured:
        return configured
    env = os.environ.get("LOWDIFF_PEER_ADDR", "")
    if env:
        return env
    master = os.environ.get("MASTER_ADDR", "")
    if master:
        port = os.environ.get("MASTER_PORT", "29500")
        with (
            contextlib.suppress(OSError, ValueError),
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s,
        ):
            s.connect((master, int(port)))  # a datagram socket: nothing is sent
            return str(s.getsockname()[0])
    return socket.gethostname()


def free_port(host: str) -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def memory_sources(
    found: list[tuple[int, int, int]],
) -> tuple[int, list[int]] | str:
    """Where each shard of a DDP job can be restored from in memory.

    Args:
        found: per rank, ``(step of its own replica, rank whose shard its peer copy
            holds, step of that copy)``; -1 for what it does not have.

    Returns:
        ``(step, sources)``: the step, and per shard the rank whose replica serves it
        (the shard's own rank, or the rank holding its peer copy); or why none can.

    Example:
        >>> memory_sources([(7, 1, 7), (-1, -1, -1)])
        (7, [0, 0])
        >>> memory_sources([(7, 1, 6), (-1, -1, -1)])
        "no replica in memory holds rank 1's shard at step 7"
    """
    own = {r: step for r, (step, _, _) in enumerate(found) if step >= 0}
    if not own:
        return "no rank found its replica in memory"
    steps = sorted(set(own.values()))
    if len(steps) > 1:
        return f"the replicas in memory are at different steps ({steps[0]}..{steps[-1]})"
    step = steps[0]
    sources = []
    for shard in range(len(found)):
        if own.get(shard) == step:
            sources.append(shard)
            continue
        holders = [r for r, (_, of, at) in enumerate(found) if of == shard and at == step]
        if not holders:
            return f"no replica in memory holds rank {shard}'s shard at step {step}"
        sources.append(holders[0])
    return step, sources
