"""The arms the timing experiments of ``lowdiff bench`` compare, at equal durability.

Methods are compared at the same *durable interval* ``k``: the steps between two points at
which the whole training state is recoverable from disk. LowDiff at ``k`` writes its
records in batches of ``b = k``; LowDiff+ persists its replica every ``k`` steps; Gemini
keeps a checkpoint in its holder's memory every step and persists every ``k``-th;
torch.save, CheckFreq and DCP async checkpoint every ``k`` steps; Naive DC writes a
difference every ``k`` steps. LowDiff, LowDiff+ and Gemini also hand every step to a
process that outlives a crash of the trainer (:attr:`Arm.memory_every` is 1).
"""

from __future__ import annotations

from lowdiff_lab.bench.context import Profile
from lowdiff_lab.bench.core import Arm

DCP_MODES = ("thread", "process")
"""DCP ``async_save`` savers the timing experiments compare (the thread saver is DCP's
default and torchtitan's ``async`` mode)."""


def full_every_at(p: Profile, k: int) -> int:
    """LowDiff's f at durable interval k: the profile's f, or k when k is larger."""
    return max(p.lowdiff_full_every, k)


def compressed_arms(p: Profile, interval: int = 1, *, own_policies: bool = False) -> list[Arm]:
    """Compressed training at durable interval ``interval``: no checkpoint, LowDiff with
    ``b = interval``, and every baseline (see the module docstring)."""
    r, k = p.ratio, interval
    return [
        Arm("W/O CKPT", "none", r),
        Arm(
            "LowDiff",
            "lowdiff",
            r,
            full_every_at(p, k),
            (("batch_size", k),),
            durable_every=k,
            memory_every=1,
        ),
        *baseline_arms(p, r, k, dcp_modes=DCP_MODES, own_policies=own_policies),
    ]


def uncompressed_arms(p: Profile, interval: int = 1, *, own_policies: bool = False) -> list[Arm]:
    """Uncompressed training at durable interval ``interval``: no checkpoint, LowDiff+
    persisting every ``interval`` steps, and every baseline."""
    k = interval
    return [
        Arm("W/O CKPT", None),
        Arm(
            "LowDiff+",
            "lowdiff+",
            None,
            full_every_at(p, k),
            (("persist_every", k),),
            durable_every=k,
            memory_every=1,
        ),
        *baseline_arms(p, None, k, dcp_modes=DCP_MODES, own_policies=own_policies),
    ]


def baseline_arms(
    p: Profile,
    ratio: float | None,
    interval: int | None,
    *,
    dcp_modes: tuple[str, ...] = ("thread",),
    own_policies: bool = False,
) -> list[Arm]:
    """The baselines at durable interval ``interval``.

    ``interval=None``: Gemini checkpoints every step and persists every
    ``p.gemini_persist_every``, the others checkpoint every step (``fidelity``).
    ``own_policies`` adds CheckFreq with its own adaptive interval (``full_every="auto"``).
    With one DCP mode its label is ``"DCP async"``, else the mode is named.
    """
    nd_ratio = p.ratio if ratio is None else ratio
    k = 1 if interval is None else interval
    persist = p.gemini_persist_every if interval is None else interval
    arms = [
        Arm("torch.save", "torch-save", ratio, k, durable_every=k, memory_every=k),
        Arm("CheckFreq", "checkfreq", ratio, k, durable_every=k, memory_every=k),
    ]
    if own_policies:
        arms.append(Arm("CheckFreq (auto)", "checkfreq", ratio, "auto"))
    arms += [
        Arm(
            "Gemini",
            "gemini",
            ratio,
            1,
            (("persist_every", persist),),
            durable_every=persist,
            memory_every=1,
        ),
        Arm(
            "Naive DC",
            "naive-dc",
            ratio,
            full_every_at(p, k),
            (("ratio", nd_ratio), ("diff_every", k)),
            durable_every=k,
            memory_every=k,
        ),
    ]
    for mode in dcp_modes:
        label = "DCP async" if len(dcp_modes) == 1 else f"DCP async ({mode})"
        arms.append(
            Arm(
                label,
                "dcp-async",
                ratio,
                k,
                (("async_mode", mode),),
                durable_every=k,
                memory_every=k,
            )
        )
    return arms
