"""Naive DC's recovery: the newest intact full checkpoint, then the chain of differentials.

Each differential is checked against the state rebuilt so far before anything of it is
applied (``add`` / top-k scatter-add / replace). The chain stops, with a
:class:`lowdiff.RecoveryWarning` naming the file, at the first differential that is
damaged or does not continue that state (its base checkpoint is missing); what lies past
the recovered step is moved to ``DIR/quarantine/``. :func:`recovery_error` measures how
far a recovered state lies from the training state it stands for.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lowdiff.compressors.base import check_payload, compressor_from_spec
from lowdiff.errors import CorruptCheckpointError, RecoveryWarning
from lowdiff.format import layout
from lowdiff.recovery.stats import RecoveryStats
from lowdiff_lab.baselines.files import commit_path, load_state, published, quarantine
from lowdiff_lab.baselines.naive_dc_record import (
    DIFF_DIR,
    DIFF_KIND,
    DIFF_PREFIX,
    FULL_PREFIX,
    SUFFIX,
    add_sparse,
)

_WARN_LEVEL = 6
"""``stacklevel`` of recovery's warnings: the frame of :meth:`lowdiff.Checkpointer.resume`."""


class ChainBreak(CorruptCheckpointError):
    """An intact differential that continues a checkpoint the chain does not have."""

    def __init__(self, path: Path, missing: int, reached: int) -> None:
        self.missing, self.reached = missing, reached
        super().__init__(path, f"applies to the state at step {missing}")


def check_diff(rec: Any, step: int, base_step: int, state: dict[str, Any], path: Path) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``rec`` applies to the state rebuilt so far.

    Everything is checked before anything is applied, so a bad record leaves the state
    untouched.
    """
    if not isinstance(rec, dict) or rec.get("kind") != DIFF_KIND or rec.get("step") != step:
        raise CorruptCheckpointError(path, "not the differential its name says")
    if rec["base_step"] != base_step:
        raise ChainBreak(path, rec["base_step"], base_step)
    model = state["model"]
    try:
        model_fields = compressor_from_spec(rec["model_compressor"]).fields
        for name, payload in rec["params"].items():
            check_payload(name, payload, model_fields(model[name].numel(), model[name].dtype))
        opt_spec = rec["optimizer_compressor"]
        old_state = state["optimizer"]["state"]
        for idx, entry in rec["optimizer"]["state"].items():
            for k, op in entry.items():
                if op["op"] == "set":
                    continue
                t = old_state[idx][k]
                if op["op"] == "add":
                    if op["delta"].shape != t.shape or op["delta"].dtype != t.dtype:
                        raise ValueError(f"optimizer state {idx}.{k}: shape or dtype differs")
                elif op["op"] == "topk" and opt_spec is not None:
                    fields = compressor_from_spec(opt_spec).fields(t.numel(), t.dtype)
                    check_payload(f"optimizer state {idx}.{k}", op, fields)
                else:
                    raise ValueError(f"unknown operation {op['op']!r}")
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptCheckpointError(path, f"does not fit the state it continues ({e!s})") from None


def apply_diff(state: dict[str, Any], rec: dict[str, Any], stats: RecoveryStats) -> None:
    """Turn the state at ``rec["base_step"]`` into the state at ``rec["step"]``, in place."""
    decode_s = 0.0
    t_start = time.perf_counter()
    model = state["model"]
    sparse: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    old_state = state["optimizer"]["state"]
    new_state: dict[Any, dict[str, Any]] = {}
    for idx, entry in rec["optimizer"]["state"].items():
        out: dict[str, Any] = {}
        for k, op in entry.items():
            if op["op"] == "set":
                out[k] = op["value"]
            elif op["op"] == "add":
                out[k] = old_state[idx][k].add_(op["delta"])
            else:
                out[k] = old_state[idx][k]
                sparse.append((out[k], op["values"], op["indices"]))
        new_state[idx] = out
    sparse += [(model[n], p["values"], p["indices"]) for n, p in rec["params"].items()]
    for t, values, indices in sparse:
        t0 = time.perf_counter()
        wide = indices.long()  # the top-k decompression: widen the indices
        decode_s += time.perf_counter() - t0
        add_sparse(t, values, wide)
    model.update(rec["params_set"])
    model.update(rec["model_rest"])
    state["optimizer"] = {"state": new_state, "param_groups": rec["optimizer"]["param_groups"]}
    state["scheduler"] = rec["scheduler"]
    state["rng"] = rec["rng"]
    state["step"] = rec["step"]
    stats.decode_s += decode_s
    stats.replay_s += time.perf_counter() - t_start - decode_s


class ChainRecovery:
    """Rebuilds the newest recoverable state of a Naive DC directory (not yet loaded).

    Call :meth:`run` once: it returns the state (as :func:`lowdiff_lab.baselines.base.capture_state`
    makes it) with its step and statistics, or None when no full checkpoint is intact.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.full_dir, self.diff_dir = root / layout.FULL_DIR, root / DIFF_DIR
        self.skipped: list[tuple[str, str]] = []

    def _pass_over(self, path: Path, reason: str, what: str) -> None:
        self.skipped.append((str(path), reason))
        warnings.warn(f"recovery {what} {path}: {reason}", RecoveryWarning, stacklevel=_WARN_LEVEL)

    def run(self, aliases: Mapping[str, str]) -> tuple[dict[str, Any], int, RecoveryStats] | None:
        """The rebuilt state (tied parameters under every name in ``aliases``), its step
        and its statistics."""
        full = self._newest_full()
        if full is None:
            return None
        state, stats = full
        step = self._replay(state, stats)
        for alias, name in aliases.items():
            if name in state["model"]:
                state["model"][alias] = state["model"][name]
        stats.step = step
        stats.skipped = self.skipped
        return state, step, stats

    def _newest_full(self) -> tuple[dict[str, Any], RecoveryStats] | None:
        """The newest intact full checkpoint; damaged ones are quarantined."""
        for fstep, path in reversed(published(self.full_dir, FULL_PREFIX, SUFFIX)):
            stats = RecoveryStats(full_step=fstep, step=fstep)
            try:
                loaded = load_state(path, stats)
                if not isinstance(loaded, dict) or loaded.get("step") != fstep:
                    raise CorruptCheckpointError(path, "its contents do not match its name")
            except CorruptCheckpointError as e:
                self._pass_over(e.path, e.reason, "passed over")
                quarantine(self.root, path)
                continue
            return loaded, stats
        return None

    def _replay(self, state: dict[str, Any], stats: RecoveryStats) -> int:
        """Apply the differentials after the full checkpoint, in order, up to the first
        that does not continue; returns the step reached."""
        step = stats.full_step
        beyond: list[Path] = []
        chain = [(s, p) for s, p in published(self.diff_dir, DIFF_PREFIX, SUFFIX) if s > step]
        for n, (s, path) in enumerate(chain):
            try:
                rec = load_state(path, stats)
                check_diff(rec, s, step, state, path)
            except ChainBreak as e:
                # intact, but the checkpoint it continues is missing or was damaged
                missing = self._missing(e.missing)
                self._pass_over(
                    missing,
                    f"missing or damaged ({path.name} continues it); the chain ends at step {step}",
                    "stopped at",
                )
                # a commit file left without its data goes too
                beyond = [missing] + [p for _, p in chain[n:]]
                break
            except CorruptCheckpointError as e:
                self._pass_over(e.path, f"{e.reason}; the chain ends at step {step}", "stopped at")
                beyond = [p for _, p in chain[n:]]
                break
            apply_diff(state, rec, stats)
            step = s
            stats.records_replayed += 1
        self._quarantine_beyond(beyond, step)
        return step

    def _missing(self, step: int) -> Path:
        """The file a differential continues: a full checkpoint passed over as damaged,
        else the differential of that step."""
        damaged = {Path(p).name for p, _ in self.skipped}
        full = self.full_dir / f"{FULL_PREFIX}{step:012d}{SUFFIX}"
        return full if full.name in damaged else self.diff_dir / f"{DIFF_PREFIX}{step:012d}{SUFFIX}"

    def _quarantine_beyond(self, beyond: list[Path], step: int) -> None:
        moved = [p for p in beyond if p.exists() or commit_path(p).exists()]
        for path in moved:
            quarantine(self.root, path)
        if moved:
            warnings.warn(
                f"recovery moved {len(moved)} differential(s) from {moved[0].name} on "
                f"(past the recovered step {step}) to {self.root / layout.QUARANTINE_DIR}",
                RecoveryWarning,
                stacklevel=_WARN_LEVEL,
            )


# --------------------------------------------------------------------------- the error


def recovery_error(
    want_state: Mapping[str, torch.Tensor], got_state: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """How far a recovered state lies from the state it stands for.

    Both arguments are flat states as :func:`lowdiff.state.capture.snapshot_state` returns
    them (``"model/<name>"``, ``"optim/<path>"``, JSON and RNG entries).

    Returns:
        ``model_max_abs`` / ``optimizer_max_abs``: the largest absolute difference of any
        floating-point entry of the model's state (parameters and buffers) / of the
        optimizer's state tensors; ``model_max_rel`` / ``optimizer_max_rel``: the largest,
        over those tensors, of ``max|got - want| / max|want|`` (each tensor's error
        relative to its own scale, in the max norm); ``model_rel_l2`` /
        ``optimizer_rel_l2``: ``||got - want||_2 / ||want||_2`` over the whole group;
        ``other_differences``: every other entry (integer tensors, JSON, RNG) that is not
        bit-identical, and every entry that is missing, extra, or of another shape or
        dtype. For a Naïve DC recovery ``other_differences`` is empty: step, counters,
        hyperparameters, scheduler and RNG states are exact.

    Example:
        >>> err = recovery_error(snapshot_state(*reference), snapshot_state(*recovered))  # doctest: +SKIP
        >>> err["model_max_rel"], err["other_differences"]  # doctest: +SKIP
        (0.03, [])
    """
    groups: dict[str, dict[str, float]] = {
        g: {"max_abs": 0.0, "max_rel": 0.0, "sq_diff": 0.0, "sq_ref": 0.0}
        for g in ("model", "optimizer")
    }
    other: list[str] = [f"missing {k}" for k in want_state.keys() - got_state.keys()]
    other += [f"extra {k}" for k in got_state.keys() - want_state.keys()]
    for k in sorted(want_state.keys() & got_state.keys()):
        a, b = want_state[k], got_state[k]
        group = (
            "model" if k.startswith("model/") else "optimizer" if k.startswith("optim/") else None
        )
        if a.dtype != b.dtype or a.shape != b.shape:
            other.append(f"{k} (dtype or shape)")
        elif group is None or not a.is_floating_point():
            if not torch.equal(a, b):
                other.append(k)
        elif a.numel():
            a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
            g = groups[group]
            diff = (b64 - a64).abs()
            top, ref = float(diff.max()), float(a64.abs().max())
            g["max_abs"] = max(g["max_abs"], top)
            g["max_rel"] = max(g["max_rel"], top / ref if ref else top)
            g["sq_diff"] += float(diff.square().sum())
            g["sq_ref"] += float(a64.square().sum())
    out: dict[str, Any] = {}
    for name, g in groups.items():
        out[f"{name}_max_abs"] = g["max_abs"]
        out[f"{name}_max_rel"] = g["max_rel"]
        out[f"{name}_rel_l2"] = (
            math.sqrt(g["sq_diff"] / g["sq_ref"]) if g["sq_ref"] else math.sqrt(g["sq_diff"])
        )
    out["other_differences"] = sorted(other)
    return out
