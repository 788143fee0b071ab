"""``full_every="auto"`` / ``batch_size="auto"``: the planner fed from the live session.

:class:`AutoPlan` measures what the cost model of :mod:`lowdiff.plan` needs as training
runs (the time between steps without checkpointing work, the optimizer step that stands
for the replay of one record, decompression, record and full-checkpoint writes), asks
the :class:`lowdiff.plan.AutoTuner` for a new (f, b) when one is due, and applies it:
the next full checkpoint is due f steps after the previous one, and the checkpointing
process writes its partial batch, then batches b records per file.

Each plan is also left in the directory (``.lowdiff.plan.json``: f, b, the MTBF and the
record layout it was made for). A trainer restarted on the directory with the same MTBF
and model starts from it instead of the default (30, 3), and profiles from there: after
frequent failures it does not go back to long chains of records to replay. The file is
a hint: a missing, unreadable or foreign one means the default start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine.trainer.progress import Cadence, Progress
from lowdiff.engine.trainer.training import TrainingObjects
from lowdiff.engine.wire.messages import BatchSize
from lowdiff.errors import InvalidArgumentError
from lowdiff.format import layout
from lowdiff.format.atomic import TMP_PREFIX
from lowdiff.options import check_int
from lowdiff.plan import AutoTuner, resolve_mtbf
from lowdiff.state import capture as st

_plan_log = logging.getLogger("lowdiff.plan")


class AutoPlan:
    """The ``"auto"`` planner of one session (LowDiff, single process).

    Args:
        objects: the training objects (the record layout, what a full checkpoint holds).
        progress: the session's steps.
        cadence: the (f, b) in use, changed in place by each plan.
        root: the checkpoint directory (where the plan is left for a restart).
        mtbf: the ``mtbf`` option (None: the environment's, else the default).
        tune_f, tune_b: which of f and b are ``"auto"``.
        send: sends a request to the checkpointing process.
    """

    def __init__(
        self,
        objects: TrainingObjects,
        progress: Progress,
        cadence: Cadence,
        root: Path,
        mtbf: float | None,
        *,
        tune_f: bool,
        tune_b: bool,
        send: Callable[[Any], None],
    ) -> None:
        assert objects.layout is not None
        self.objects, self.progress, self.cadence, self.root = objects, progress, cadence, root
        self.send = send
        mtbf_s, self.mtbf_source = resolve_mtbf(mtbf)
        self.mtbf_s, self.layout_id = mtbf_s, objects.layout_id
        f, b = cadence.full_every, cadence.batch_size
        self.previous = load_plan(root, self.layout_id, mtbf_s)
        """The (f, b) of the previous session's last plan on this directory, if any."""
        if self.previous is not None:
            f = self.previous[0] if tune_f else f
            b = self.previous[1] if tune_b else b
        self.tuner = AutoTuner(
            record_bytes=objects.layout.row_bytes,
            mtbf=mtbf_s,
            tune_f=tune_f,
            tune_b=tune_b,
            f=f,
            b=b,
        )
        cadence.set(self.tuner.f, self.tuner.b)
        self._step_t: float | None = None
        self._ck_s = 0.0

    # ------------------------------------------------------------------ observations
    def begin_step(self, t: int) -> None:
        """tau: the time between two steps without the previous one's checkpointing."""
        tuner, now = self.tuner, time.perf_counter()
        if self._step_t is None:
            stats = self.progress.recovery_stats
            if stats is not None and stats.records_replayed:
                # what replaying a record really cost this trainer, a moment ago
                tuner.observe_recovery(stats.records_replayed, stats.records_s)
            if not tuner.history:
                why = "start (profiling)"
                if self.previous is not None:
                    why = "start (the previous session's plan; profiling)"
                tuner.force(t, self.cadence.full_every, self.cadence.batch_size, why)
        else:
            tuner.observe_iteration(now - self._step_t - self._ck_s)
        self._step_t = now

    def observe_update(self, update_s: float) -> None:
        """The update's time stands for the replay of one record."""
        self.tuner.observe_optimizer_step(update_s)

    def checkpointing_done(self, since: float, extra_s: float) -> None:
        """This step's checkpointing work began at ``since`` (``perf_counter``), plus
        ``extra_s`` of profiling: left out of the next tau."""
        self._ck_s = time.perf_counter() - since + extra_s

    def sample_decompress(self, payloads: dict[int, dict[str, torch.Tensor]]) -> float:
        """Decompress one record's payloads again when the planner wants a sample,
        timed (the replay's decompression); the seconds it took (0 without a sample)."""
        if not self.tuner.wants_decompress_sample or not payloads:
            return 0.0
        objects = self.objects
        t0 = time.perf_counter()
        with torch.no_grad():
            for (info, p), numel in zip(objects.params, objects.numels, strict=True):
                payload = payloads.get(info.index)
                if payload is not None:
                    objects.compressor.decompress(payload, numel, p.dtype)
        took = time.perf_counter() - t0
        self.tuner.observe_decompress(took)
        return took

    def full_due(self) -> bool:
        """A full checkpoint f steps after the previous one (f changes there)."""
        return self.progress.step - self.progress.last_full >= self.cadence.full_every

    def replan(self) -> None:
        """Ask the planner when a decision is due; apply what it decides."""
        step = self.progress.step
        if self.tuner.due(step):
            entry = self.tuner.decide(step, self._state_nbytes())
            if entry is not None:
                self.apply(entry)

    def _state_nbytes(self) -> int:
        """Bytes of the model and optimizer tensors now (a full checkpoint's payload)."""
        objects = self.objects
        msd, _ = st.model_state(objects.model)
        n = sum(v.numel() * v.element_size() for v in msd.values())
        for s in objects.optimizer.state.values():
            n += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
        return n

    # ------------------------------------------------------------------ plans
    def set_plan(self, f: int, b: int, reason: str = "forced") -> None:
        """Switch to (f, b) now, as the planner does (for tests and tools)."""
        check_int("f", f, 1)
        check_int("b", b, 1)
        if b > f:
            raise InvalidArgumentError(f"need 1 <= b <= f, got f={f}, b={b}")
        self.apply(self.tuner.force(self.progress.step, f, b, reason))

    def apply(self, entry: dict[str, Any]) -> None:
        """Use ``entry``'s (f, b), and log why."""
        f, b = int(entry["f"]), int(entry["b"])
        if b != self.cadence.batch_size:
            self.send(BatchSize(b))
        self.cadence.set(f, b)
        save_plan(self.root, self.layout_id, self.mtbf_s, f, b)
        m = entry.get("inputs")
        why = ""
        if m is not None:
            why = (
                f"; predicted wasted time {entry['previous_wasted_s']:.4g} -> {entry['wasted_s']:.4g} "
                f"GPU-s per hour of training (MTBF {m['mtbf']:.4g} s from {self.mtbf_source}, "
                f"tau {m['tau'] * 1e3:.3g} ms, W {m['write_bw'] / 1e6:.3g} MB/s, "
                f"latency {m['batch_latency'] * 1e3:.3g} ms, full {m['full_bytes'] / 1e6:.3g} MB, "
                f"record {m['record_bytes'] / 1e3:.3g} kB)"
            )
        _plan_log.info(
            "%s: step %d: full_every %d -> %d, batch_size %d -> %d (%s%s)",
            self.root,
            entry["step"],
            entry["previous_f"],
            f,
            entry["previous_b"],
            b,
            entry["reason"],
            why,
        )


def load_plan(root: Path | None, layout_id: str, mtbf: float) -> tuple[int, int] | None:
    """The (f, b) left in ``root`` by the planner of a previous session with the same
    record layout and MTBF; None when there is none (or it is unreadable or foreign)."""
    if root is None:
        return None
    try:
        doc = json.loads((root / layout.PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("layout_id") != layout_id or doc.get("mtbf") != mtbf:
        return None
    f, b = doc.get("f"), doc.get("b")
    if type(f) is not int or type(b) is not int or not 1 <= b <= f:
        return None
    return f, b


def save_plan(root: Path | None, layout_id: str, mtbf: float, f: int, b: int) -> None:
    """Leave the plan in use in ``root`` for a restarted trainer (replaced whole; not
    synced: losing it only means the default start)."""
    if root is None:
        return
    doc = {"f": f, "b": b, "mtbf": mtbf, "layout_id": layout_id}
    tmp = root / f"{TMP_PREFIX}plan-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, root / layout.PLAN_FILE)
    except OSError as e:
        _plan_log.warning("%s: cannot leave the plan for a restart: %s", root, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
