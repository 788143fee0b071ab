"""Storage-fault torture: the disk fills up or fails (``ENOSPC``, ``EIO``) mid-write.

Each scenario injects one fault into the checkpointing process (before a write, before
the fsync, before the rename; into a record file or a full checkpoint) and checks that

- the trainer learns of it: under ``on_storage_error="raise"`` its next ``step()``
  (or the one after, while the error travels) raises :class:`CheckpointWorkerError`
  naming the error and the file; under ``"warn"`` a :class:`DurabilityWarning` says how
  many steps are not durable, training goes on, and checkpointing resumes once the disk
  works again;
- no partial file ever becomes visible: no temp file is left, every file verifies;
- recovery reaches at least the step acknowledged durable before the fault, with the
  reference state.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import lowdiff
from lowdiff.format import atomic
from lowdiff.state.capture import diff_states, state_tensors
from lowdiff_lab import faults
from lowdiff_lab.torture import workload
from lowdiff_lab.torture.report import TortureReport

N_STEPS = 16

# (point, file kind, nth, action, policy)
SCENARIOS: list[tuple[str, str, int, str, str]] = [
    ("before_write", "records", 2, "enospc", "raise"),
    ("before_fsync", "full", 2, "eio", "raise"),
    ("before_fsync", "records", 2, "enospc", "warn"),
    ("before_fsync", "records", 1, "eio", "raise"),
    ("before_write", "full", 2, "enospc", "raise"),
    ("before_rename", "records", 3, "eio", "raise"),
    ("before_rename", "full", 3, "enospc", "raise"),
    ("before_write", "full", 2, "eio", "warn"),
    ("before_write", "records", 1, "enospc", "warn"),
    ("before_rename", "full", 2, "eio", "warn"),
    ("before_write", "records", 4, "eio", "raise"),
    ("before_fsync", "full", 3, "enospc", "warn"),
]


@workload.one_thread()  # the thread count the reference was computed with
def run_scenario(
    d: Path,
    point: str,
    kind: str,
    nth: int,
    action: str,
    policy: str,
    report: TortureReport,
    ref: list[dict[str, torch.Tensor]],
) -> None:
    """Train with one injected fault in ``d`` and check what the trainer and disk show."""
    what = f"{action} at {point} of {kind} #{nth} ({policy})"
    strerror = os.strerror(errno.ENOSPC if action == "enospc" else errno.EIO)
    report.storage_faults += 1
    os.environ[faults.FAULT_ENV] = f"{point}:{kind}:{nth}:{action}"
    try:
        ck, model, opt, _ = workload.checkpointer(d, on_storage_error=policy, keep_full=2)
        ck.resume()  # the checkpointing process has read the fault by now
    finally:
        del os.environ[faults.FAULT_ENV]  # the disk "works again" for any later process
    acked, surfaced, trained = -1, False, 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(N_STEPS):
                workload.loss_at(model, step).backward()
                ck.step()
                opt.zero_grad()
                trained = step + 1
                if not surfaced:
                    acked = max(acked, ck.durable_step)
                if any(issubclass(w.category, lowdiff.DurabilityWarning) for w in caught):
                    surfaced = surfaced or _warned(caught, strerror)
            ck.close()
        except lowdiff.CheckpointWorkerError as e:
            text = str(e).split("\n", 1)[0]
            surfaced = policy == "raise" and strerror in text and f"/{kind}/" in text
            if not surfaced:
                report.fail(f"{what}: unclear error {text!r}")
            with contextlib.suppress(lowdiff.LowDiffError):
                ck.close()
        surfaced = surfaced or _warned(caught, strerror)
    if surfaced:
        report.storage_faults_surfaced += 1
    else:
        report.fail(f"{what}: the fault did not reach the trainer")
    leftovers = [p for p in d.rglob("*") if p.name.startswith(atomic.TMP_PREFIX)]
    bad = lowdiff.verify_dir(d)[1]
    if leftovers or bad:
        report.partial_files_visible += len(leftovers) + len(bad)
        report.fail(f"{what}: partial files visible: {leftovers + [p for p, _ in bad]}")
    m, o, s = workload.build(seed=4242)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lowdiff.RecoveryWarning)
        got = lowdiff.restore(d, m, o, s)
    if got < acked:
        report.lost_acknowledged += 1
        report.fail(f"{what}: recovered step {got} < acknowledged {acked}")
    if diff_states(ref[got], state_tensors(m, o, s)):
        report.damaged_loads += 1
        report.fail(f"{what}: recovered step {got} differs from the reference")
    if policy == "warn" and got != trained:
        report.fail(f"{what}: training went on to {trained} but checkpointing did not resume")


def _warned(caught: list[warnings.WarningMessage], strerror: str) -> bool:
    return any(
        issubclass(w.category, lowdiff.DurabilityWarning)
        and strerror in str(w.message)
        and "not durable" in str(w.message)
        for w in caught
    )


def run_storage(
    workdir: Path,
    report: TortureReport,
    *,
    scenarios: int = 3,
    reference: list[dict[str, torch.Tensor]] | None = None,
    log: Callable[[str], None] | None = None,
) -> None:
    """Run the first ``scenarios`` of :data:`SCENARIOS` (cycling when asked for more)."""
    ref = reference if reference is not None else workload.reference(N_STEPS)
    for i in range(scenarios):
        point, kind, nth, action, policy = SCENARIOS[i % len(SCENARIOS)]
        d = Path(workdir) / f"storage-{i}"
        shutil.rmtree(d, ignore_errors=True)
        run_scenario(d, point, kind, nth + i // len(SCENARIOS), action, policy, report, ref)
    if log:
        log(f"storage: {report.storage_faults} faults")
