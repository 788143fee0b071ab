"""The LowDiff+ replica update against a bare ``torch.optim`` step, side by side.

:func:`replica_update_bench` builds the checkpointing process's replica
(:class:`lowdiff.engine.replica.replica.Replica`) in this process, from the state of a
trainer-side optimizer, exactly as the process builds it from the ``init`` message, and
times its per-step work (decoding the step's metadata, binding the gradients of a snapshot
slot, the sharded optimizer update, the checks and copies around it, publishing the step)
against a bare ``optimizer.step()`` of the same class and flags over a copy of the same
parameters with the same gradients and state. The replica runs ``threads`` shards of one
thread each, as in its process; the bare step runs with ``torch.set_num_threads(threads)``.
Blocks of the two alternate and the per-step medians are compared, so load from other
work on the machine hits both alike. At the end both hold the same step count, and the
bench checks that they hold the same bits.

Example:
    >>> rows = replica_update_bench(n_params=200_000, threads=(1,), repeats=3, steps=3)
    >>> rows[0]["identical"]
    True
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowdiff.compressors import NoCompression
from lowdiff.engine.replica.optim import optimizer_class
from lowdiff.engine.replica.replica import Replica
from lowdiff.engine.wire.configs import ReplicaConfig
from lowdiff.format import codec
from lowdiff.format.dtypes import dtype_name
from lowdiff.format.sfile import plan, view_tensors
from lowdiff.proc import holder as rp
from lowdiff.state import capture as st
from lowdiff.state.record import RecordLayout

REPLICA_TARGET = 1.2
"""Issue target: the replica's per-step update at most 1.2x a bare ``torch.optim`` step."""

DEFAULT_KERNELS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("torch.optim.AdamW", {"fused": True}),
    ("torch.optim.AdamW", {"foreach": True}),
)
"""The optimizer classes and flags the bench compares by default."""


SHAPES = ("blocks", "gpt2-117m")
"""Parameter sets of the bench: ``"blocks"`` (about ``n_params`` elements in equal
blocks) and ``"gpt2-117m"`` (the 117.8M-parameter GPT-2 of ``benchmarks/gpu_reference.py``:
8 layers of width 1,024, a 16,384-token embedding, 256 positions)."""

CLIP_FACTOR = 0.9
"""With ``clip=True``: the factor every step's gradients are clipped by (the clip fires)."""


def gpt2_shapes(n_layer: int, d: int, vocab: int, positions: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a GPT-2 (``transformers``' ``GPT2LMHeadModel``, tied head)."""
    layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # fmt: skip
    return [(vocab, d), (positions, d), *(layer * n_layer), (d,), (d,)]


def bench_shapes(n_params: int, shapes: str = "blocks") -> list[tuple[int, ...]]:
    """Parameter shapes (:data:`SHAPES`): for ``"blocks"``, about ``n_params`` elements in
    blocks of a square linear layer (weight, bias) and a layer norm (weight, bias), as in
    a small transformer."""
    if shapes == "gpt2-117m":
        return gpt2_shapes(8, 1024, 16384, 256)
    if shapes != "blocks":
        raise ValueError(f"shapes must be one of {SHAPES}, got {shapes!r}")
    d = 512 if n_params >= 4 * (512 * 512 + 3 * 512) else 64
    per = d * d + 3 * d
    blocks = max(2, round(n_params / per))
    return [s for _ in range(blocks) for s in ((d, d), (d,), (d,), (d,))]


class _Harness:
    """One replica and one bare optimizer over copies of the same parameters."""

    def __init__(
        self,
        optimizer: str,
        flags: dict[str, Any],
        threads: int,
        n_params: int,
        seed: int,
        shapes: str = "blocks",
        clip: bool = False,
    ) -> None:
        cls = optimizer_class(optimizer)
        g = torch.Generator().manual_seed(seed)
        self.clip = clip
        shape_list = bench_shapes(n_params, shapes)
        self.n_params = sum(torch.Size(s).numel() for s in shape_list)
        self.threads = threads
        trainer = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shape_list]
        self.grads = [torch.randn(s, generator=g) * 1e-3 for s in shape_list]
        hp = {"lr": 1e-3, **flags}
        topt = cls(trainer, **hp)  # type: ignore[call-arg]
        for p, gr in zip(trainer, self.grads, strict=True):
            p.grad = gr.clone()
        topt.step()  # the state exists from here on, in the replica's arena from its start
        self.steps = 1
        # the bare twin: same class, flags, parameters, state and gradients
        self.bare_params = [torch.nn.Parameter(p.detach().clone()) for p in trainer]
        self.bare = cls(self.bare_params, **hp)  # type: ignore[call-arg]
        self.bare.load_state_dict(topt.state_dict())
        for p, gr in zip(self.bare_params, self.grads, strict=True):
            p.grad = gr

        # the record layout and one snapshot slot, filled as the trainer fills it
        infos = [st.ParamInfo(i, f"p{i}", tuple(p.shape), p.dtype) for i, p in enumerate(trainer)]
        rng_layout = st.RngLayout()
        self.layout = RecordLayout.build(infos, NoCompression(), [], rng_layout)
        self.row = torch.zeros(self.layout.row_bytes, dtype=torch.uint8)
        self.copy_row: torch.Tensor | None = None
        views = self.layout.views(self.row)
        for i, gr in enumerate(self.grads):
            views[f"g{i}.values"].copy_(gr.reshape(-1))
        rng_t, rng_extra = st.capture_rng(rng_layout)
        for k, v in rng_t.items():
            views[k].copy_(v)
        self.hp = st.capture_hparams(topt)
        self.rng_extra = rng_extra

        # the init message: the staged state and its metadata
        otensors, ojson = st.optimizer_state_tensors(topt)
        tensors: dict[str, torch.Tensor] = {
            f"model/p{i}": p.detach() for i, p in enumerate(trainer)
        }
        tensors.update(otensors)
        tensors.update(rng_t)
        entries, size = plan((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
        staging = torch.empty(max(size, 1), dtype=torch.uint8)
        sv = view_tensors(entries, staging[:size])
        for k, v in tensors.items():
            sv[k].copy_(v)
        entries_json = rp.entries_to_json(entries)
        run_id = uuid.uuid4().hex
        self.tmp = tempfile.TemporaryDirectory(prefix="lowdiff-bench-replica-")
        cfg = ReplicaConfig(
            self.tmp.name,
            run_id,
            self.layout.to_json(),
            optimizer,
            10**9,
            None,
            0.0,
            threads,
        )
        self.ctl_shm = rp.create_segment(f"lowdiff-{run_id[:16]}-ctl", rp.CTL_BYTES)
        self.rep = Replica(cfg, rp.ControlBlock(self.ctl_shm))
        meta = {
            "model_aliases": codec.dumps({}),
            "optim": ojson,
            "rng": codec.dumps(rng_extra),
            "scheduler": "null",
        }
        self.rep.init_from(staging, self.steps, entries_json, meta)

    def merge(self) -> float:
        """One replica step, timed as the checkpointing process times it (plus decoding)."""
        meta: dict[str, Any] = {
            "step": self.rep.step,
            "nograd": [],
            "hp": self.hp,
            "hp_after": self.hp,
            "sched": None,
            "rng": self.rng_extra,
        }
        if self.clip:  # the slot holds the gradients as they were before the clip
            meta["scale"] = [dtype_name(torch.float32), CLIP_FACTOR, []]
        meta_json = codec.dumps(meta)
        saved = torch.get_num_threads()
        torch.set_num_threads(1)  # the replica process: one thread per shard
        try:
            t0 = time.perf_counter()
            self.rep.merge(self.row, self.rep.step, codec.loads(meta_json))
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(saved)

    def bare_step(self) -> float:
        """One bare ``optimizer.step()`` with ``threads`` torch threads, timed (with
        ``clip``, the gradients are first multiplied by the clip's factor, untimed, as
        the replica multiplies its copies: the same bits on both sides)."""
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            if self.clip:
                torch._foreach_mul_(self.grads, torch.tensor(CLIP_FACTOR))
            t0 = time.perf_counter()
            self.bare.step()
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(saved)

    def copy_in(self) -> float:
        """The trainer's part: every gradient copied into a snapshot slot with
        ``threads`` torch threads (one foreach copy, as a whole step's blocks), timed."""
        if self.copy_row is None:  # its own row: the merged slot keeps its bits
            self.copy_row = torch.zeros_like(self.row)
        views = self.layout.views(self.copy_row)
        dsts = [views[f"g{i}.values"] for i in range(len(self.grads))]
        srcs = [x.reshape(-1) for x in self.grads]
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            t0 = time.perf_counter()
            torch._foreach_copy_(dsts, srcs)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(saved)

    def identical(self) -> bool:
        """Same bits in the replica and the bare twin (parameters and optimizer state)."""
        assert self.rep.opt is not None
        if not all(
            torch.equal(p, q) for p, q in zip(self.rep.params, self.bare_params, strict=True)
        ):
            return False
        for p, q in zip(self.rep.params, self.bare_params, strict=True):
            a, b = self.rep.opt.state.get(p, {}), self.bare.state.get(q, {})
            if a.keys() != b.keys():
                return False
            for k in a:
                x, y = a[k], b[k]
                same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                if not same:
                    return False
        return True

    def close(self) -> None:
        """Close the replica and remove its shared memory and folder."""
        self.rep.close()
        rp.unlink_segment(self.ctl_shm.name)
        self.ctl_shm.close()
        self.tmp.cleanup()


def replica_update_bench(
    *,
    n_params: int = 8_437_760,
    threads: Sequence[int] = (1, 2),
    kernels: Sequence[tuple[str, dict[str, Any]]] = DEFAULT_KERNELS,
    repeats: int = 7,
    steps: int = 5,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    shapes: str = "blocks",
    clip: bool = False,
) -> list[dict[str, Any]]:
    """Time the replica's update against a bare ``torch.optim`` step, side by side.

    Args:
        n_params: Parameters of the update (default: 8.4M, 128 tensors).
        threads: ``replica_threads`` values to measure; the bare step gets as many torch
            threads.
        kernels: (optimizer class path, flags) pairs.
        repeats: Alternating blocks per side; the figures are medians over every step.
        steps: Timed steps per block (after one untimed step per side).
        seed: Seed of the parameters and gradients.
        progress: Called with a short status text per case.
        shapes: The parameter set (:data:`SHAPES`; ``"gpt2-117m"`` ignores ``n_params``).
        clip: Gradient clipping that fires on every step (factor :data:`CLIP_FACTOR`),
            carried to the replica as ``ck.clip_grad_norm_`` carries it: the replica
            multiplies its copies, the bare step's gradients are multiplied untimed.

    Returns:
        One row per (kernel, threads): ``replica_s`` and ``bare_s`` (median per step),
        ``ratio``, ``target`` (:data:`REPLICA_TARGET`), ``meets_target``, ``identical``
        (same bits after the same steps), the per-block medians, and the case;
        ``stage_s``: the replica's seconds per step in each stage of its merge (mean:
        ``bind``, ``optimizer``, ``hand_back``), and ``copy_in_s``: the trainer's copy of
        every gradient into a slot (median), for the profile of where the time goes.
    """
    if repeats < 1 or steps < 1:
        raise ValueError(f"repeats and steps must be at least 1, got {repeats} and {steps}")
    say = progress or (lambda _m: None)
    saved_threads = torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    try:
        for optimizer, flags in kernels:
            for n in threads:
                flag_s = ",".join(f"{k}={v}" for k, v in flags.items()) or "defaults"
                say(f"{optimizer.rsplit('.', 1)[-1]}({flag_s}) replica_threads={n}")
                h = _Harness(optimizer, dict(flags), n, n_params, seed, shapes, clip)
                try:
                    h.merge()  # untimed: first-step costs on both sides
                    h.bare_step()
                    h.copy_in()
                    h.rep.stage_s = dict.fromkeys(h.rep.stage_s, 0.0)
                    rep_all: list[float] = []
                    bare_all: list[float] = []
                    rep_blocks: list[float] = []
                    bare_blocks: list[float] = []
                    for r in range(repeats):
                        # alternate which side goes first, so a drift in load hits both
                        order = (h.merge, h.bare_step) if r % 2 == 0 else (h.bare_step, h.merge)
                        for fn in order:
                            ts = [fn() for _ in range(steps)]
                            (rep_all if fn == h.merge else bare_all).extend(ts)
                            (rep_blocks if fn == h.merge else bare_blocks).append(
                                statistics.median(ts)
                            )
                    same = h.identical()
                    merges = len(rep_all)
                    stage_s = {k: v / merges for k, v in h.rep.stage_s.items()}
                    copy_in_s = statistics.median(h.copy_in() for _ in range(steps))
                finally:
                    h.close()
                rep_s, bare_s = statistics.median(rep_all), statistics.median(bare_all)
                ratio = rep_s / bare_s if bare_s > 0 else float("inf")
                rows.append(
                    {
                        "optimizer": optimizer,
                        "flags": dict(flags),
                        "threads": n,
                        "n_params": h.n_params,
                        "replica_s": rep_s,
                        "bare_s": bare_s,
                        "ratio": ratio,
                        "target": REPLICA_TARGET,
                        "meets_target": ratio <= REPLICA_TARGET,
                        "identical": same,
                        "replica_block_s": rep_blocks,
                        "bare_block_s": bare_blocks,
                        "steps_per_block": steps,
                        "cpus": os.cpu_count(),
                        "shapes": shapes,
                        "clip": clip,
                        "stage_s": stage_s,
                        "copy_in_s": copy_in_s,
                    }
                )
    finally:
        torch.set_num_threads(saved_threads)
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    out = [
        "| optimizer | flags | replica_threads | parameters | replica update / step "
        "| bare torch.optim step | ratio | target | same bits |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        flags = ", ".join(f"{k}={v}" for k, v in r["flags"].items()) or "defaults"
        out.append(
            f"| {r['optimizer'].rsplit('.', 1)[-1]} | {flags} | {r['threads']} "
            f"| {r['n_params'] / 1e6:.1f}M | {r['replica_s'] * 1e3:.1f} ms "
            f"| {r['bare_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x "
            f"| ≤ {r['target']:.1f}x {'(met)' if r['meets_target'] else '(not met)'} "
            f"| {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(out)
