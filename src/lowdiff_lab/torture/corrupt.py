"""Corruption torture: flip bytes in and truncate every kind of file, check each is caught.

For every file of a clean checkpoint directory (the manifest, each full checkpoint,
each record file) and for many offsets, one mutation at a time is applied in place and
undone afterwards. Each mutation must be

- *detected*: :func:`lowdiff.verify_dir` names the damaged file;
- *never loaded*: :func:`lowdiff.restore` either refuses with a clear error (a damaged
  manifest) or returns a state bit-identical to the reference at the step it reports;
- *a fallback to the newest intact point, with a warning*: the recovered step is the
  newest step reachable without the damaged file, and when that is older than the
  newest step of the clean directory a :class:`lowdiff.RecoveryWarning` names the file.
"""

from __future__ import annotations

import random
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import lowdiff
from lowdiff.errors import CorruptCheckpointError, LowDiffError, RecoveryError
from lowdiff.format import layout
from lowdiff.recovery.scan import Scan, make_plan, scan
from lowdiff.state.capture import diff_states, state_tensors
from lowdiff_lab.torture import workload
from lowdiff_lab.torture.report import TortureReport

N_STEPS = 14  # fulls 0, 4, 8, 12; records 0-2, 3-5, 6-8, 9-11, 12-13


def _mutations(raw: bytes, flips: int, cuts: int, rng: random.Random) -> list[tuple[str, int, int]]:
    """("flip", offset, mask) and ("cut", new_length, 0), spread over the whole file."""
    n = len(raw)
    head = 8 + struct.unpack("<Q", raw[:8])[0] if n >= 8 and raw[:1] != b"{" else n
    head = min(head, n)
    # the length prefix, the header, the data: each part gets its share
    marks = {0, 1, 7, min(8, n - 1), head - 1, min(head, n - 1), n - 1}
    offsets = sorted(o for o in marks if 0 <= o < n)
    while len(offsets) < flips:
        offsets.append(int(rng.random() * n) if len(offsets) % 2 else int(n * len(offsets) / flips))
    out = [
        ("flip", o, rng.choice((0x01, 0x80, 0xFF, rng.randrange(1, 256)))) for o in offsets[:flips]
    ]
    lengths = sorted({0, 1, 7, 8, head - 1, head, n - 1} & set(range(n)))
    while len(lengths) < cuts:
        lengths.append(rng.randrange(0, n))
    out += [("cut", c, 0) for c in lengths[:cuts]]
    return out


def run_corruption(
    workdir: Path,
    report: TortureReport,
    *,
    flips: int = 8,
    cuts: int = 4,
    seed: int = 0,
    reference: list[dict[str, torch.Tensor]] | None = None,
    log: Callable[[str], None] | None = None,
) -> None:
    """Damage every file of a fresh directory in ``flips + cuts`` ways each; check each."""
    rng = random.Random(seed)
    d = Path(workdir) / "corrupt"
    if not d.exists():
        workload.train_directory(d, N_STEPS)
    ref = reference if reference is not None else workload.reference(N_STEPS)
    clean = scan(d)
    newest = make_plan(clean, None).target
    files = [d / layout.MANIFEST] + [f.path for f in clean.fulls + clean.records]
    with workload.one_thread():
        _sweep(d, files, clean, newest, ref, report, flips, cuts, rng)
    if lowdiff.verify_dir(d)[1]:
        report.fail(f"{d} was not restored after the corruption sweep")
    if log:
        log(f"corruption: {report.corruptions} mutations of {len(files)} files")


def _sweep(
    d: Path,
    files: list[Path],
    clean: Scan,
    newest: int,
    ref: list[dict[str, torch.Tensor]],
    report: TortureReport,
    flips: int,
    cuts: int,
    rng: random.Random,
) -> None:
    for path in files:
        raw = path.read_bytes()
        kind = "manifest" if path.name == layout.MANIFEST else path.parent.name
        for op, at, mask in _mutations(raw, flips, cuts, rng):
            bad = bytearray(raw)
            if op == "flip":
                bad[at] ^= mask
            else:
                del bad[at:]
            path.write_bytes(bytes(bad))
            try:
                _check(d, path, kind, clean, newest, ref, report, f"{op}@{at}")
            finally:
                path.write_bytes(raw)


def _check(
    d: Path,
    path: Path,
    kind: str,
    clean: Scan,
    newest: int,
    ref: list[dict[str, torch.Tensor]],
    report: TortureReport,
    what: str,
) -> None:
    report.corruptions += 1
    report.corruptions_by_file[kind] += 1
    named = [p for p, _ in lowdiff.verify_dir(d)[1]]
    if path in named:
        report.corruptions_detected += 1
    else:
        report.corruptions_undetected += 1
        report.fail(f"{what} in {path.name}: verify did not name the file (named {named})")
    model, opt, sched = workload.build(seed=4242)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = lowdiff.restore(d, model, opt, sched)
        except CorruptCheckpointError as e:
            if kind != "manifest" or e.path != path:
                report.fail(f"{what} in {path.name}: unexpected {e}")
            return
        except RecoveryError as e:
            step = -1
            err: LowDiffError | None = e
        else:
            err = None
    if kind == "manifest":
        report.damaged_loads += 1
        report.fail(f"{what} in the manifest: restore did not refuse it (step {step})")
        return
    try:
        expected: int | None = make_plan(clean, None, exclude={path}).target
    except RecoveryError:
        expected = None
    if err is not None:
        if expected is not None:
            report.fallback_not_newest += 1
            report.fail(f"{what} in {path.name}: {err}, though step {expected} is intact")
        return
    bad = diff_states(ref[step], state_tensors(model, opt, sched))
    if bad:
        report.damaged_loads += 1
        report.fail(f"{what} in {path.name}: restored step {step} differs: {bad[:4]}")
    if expected is not None and step < expected:
        report.fallback_not_newest += 1
        report.fail(f"{what} in {path.name}: fell back to {step}, step {expected} is intact")
    if step < newest:
        if any(path.name in str(w.message) for w in caught):
            report.fallbacks += 1
        else:
            report.fail(f"{what} in {path.name}: fell back to {step} without a warning naming it")
