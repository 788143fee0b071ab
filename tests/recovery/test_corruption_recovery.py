"""Damaged checkpoint files are detected, passed over, quarantined; recovery stays exact."""

from __future__ import annotations

import shutil
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.state.capture import diff_states as _diff
from lowdiff.state.capture import snapshot_state as _snap
from lowdiff.state.capture import state_tensors

FULL_EVERY = 4
BATCH_SIZE = 3
N_STEPS = 11  # fulls 0, 4, 8; records 0-2, 3-5, 6-8, 9-10
REF_STEPS = 16

pytestmark = pytest.mark.multiprocess


def _build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.2), nn.Linear(12, 3)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    return model, opt, sched


def _compressor() -> lowdiff.Compressor:
    # no error feedback: a resumed run continues exactly like the uninterrupted one
    return lowdiff.TopK(ratio=0.3, error_feedback=False)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + step)
    return ((model(torch.randn(5, 6, generator=g)) - torch.randn(5, 3, generator=g)) ** 2).mean()


def _checkpointer(
    model: nn.Module, opt: Any, sched: Any, d: Path, keep_full: int | None = None
) -> lowdiff.Checkpointer:
    return lowdiff.Checkpointer(
        d,
        model,
        opt,
        scheduler=sched,
        compressor=_compressor(),
        full_every=FULL_EVERY,
        records_per_file=BATCH_SIZE,
        keep_full=keep_full,
    )


def _train(
    ck: lowdiff.Checkpointer, model: nn.Module, opt: Any, sched: Any, start: int, stop: int
) -> dict[int, dict[str, torch.Tensor]]:
    snaps = {}
    for step in range(start, stop):
        _loss(model, step).backward()
        ck.step()
        opt.zero_grad()
        snaps[step + 1] = _snap(model, opt, sched)
    return snaps


@contextmanager
def _no_recovery_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", lowdiff.RecoveryWarning)
        yield


def _assert_restores(
    d: Path, ref: dict[int, dict[str, torch.Tensor]], step: int | None, expect: int
) -> None:
    model, opt, sched = _build(seed=4242)
    got = lowdiff.restore(d, model, opt, sched, step=step)
    assert got == expect
    bad = _diff(ref[expect], state_tensors(model, opt, sched))
    assert not bad, f"step {expect} differs: {bad[:8]}"


@dataclass
class Pristine:
    dir: Path
    ref: dict[int, dict[str, torch.Tensor]]
    """The state at every step 0..REF_STEPS of the uninterrupted run."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    # reference trajectory without checkpointing (same compression)
    model, opt, sched = _build()
    ck = lowdiff.Checkpointer(
        None, model, opt, method="compression-only", scheduler=sched, compressor=_compressor()
    )
    ck.resume()
    ref = {0: _snap(model, opt, sched), **_train(ck, model, opt, sched, 0, REF_STEPS)}
    ck.close()

    d = tmp_path_factory.mktemp("pristine")
    model, opt, sched = _build()
    ck = _checkpointer(model, opt, sched, d)
    try:
        assert ck.resume() == 0
        snaps = {0: _snap(model, opt, sched), **_train(ck, model, opt, sched, 0, N_STEPS)}
    finally:
        ck.close()
    for s, snap in snaps.items():
        assert not _diff(ref[s], snap), f"checkpointing changed the trajectory at step {s}"
    info = lowdiff.inspect_dir(d)
    assert [f.first_step for f in info.full_checkpoints] == [0, 4, 8]
    assert [(f.first_step, f.last_step) for f in info.record_files] == [
        (0, 2),
        (3, 5),
        (6, 8),
        (9, 10),
    ]
    return Pristine(d, ref)


def _copy(p: Pristine, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(p.dir, d, ignore=shutil.ignore_patterns(".lowdiff*.lock"))
    return d


def _rec(d: Path, first: int, last: int) -> Path:
    return d / "records" / f"rec-{first:012d}-{last:012d}.safetensors"


def _full(d: Path, step: int) -> Path:
    return d / "full" / f"full-{step:012d}.safetensors"


def _flip_data_byte(path: Path, where: float = 0.5) -> None:
    """Flip one byte in the data section (after the safetensors header)."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n
    i = start + int((len(raw) - start - 1) * where)
    raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))


def _truncate(path: Path, drop: int) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - drop])


# ----------------------------------------------------------------------------- restore


@pytest.fixture(params=["inline", "thread"])
def reader(request: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Replay's reader inline (as on the CPU) or on its thread (as with a GPU); yields
    the threads started, checked at the end."""
    from lowdiff.recovery import replay

    started: list[int] = []
    original = replay._Reader.start

    def start(self: Any) -> None:
        started.append(1)
        original(self)

    monkeypatch.setattr(replay, "reader_thread", lambda devices: request.param == "thread")
    monkeypatch.setattr(replay._Reader, "start", start)
    yield started
    assert bool(started) == (request.param == "thread")


def test_pristine_directory_verifies_and_restores(pristine: Pristine, reader: list[int]) -> None:
    assert lowdiff.verify_dir(pristine.dir) == (1 + 3 + 4, [])
    with _no_recovery_warning():
        for s in (0, 5, 9, N_STEPS):
            _assert_restores(pristine.dir, pristine.ref, s, s)


def _flip_header_byte(path: Path) -> None:
    """Change one character of the run id in the header (the JSON stays valid)."""
    raw = path.read_bytes()
    i = raw.index(b'"run_id":"') + len(b'"run_id":"')
    path.write_bytes(raw[:i] + (b"0" if raw[i : i + 1] != b"0" else b"1") + raw[i + 1 :])


@pytest.mark.parametrize(
    "where", [0.0, 0.5, 1.0, "header"], ids=["first-byte", "middle", "last-byte", "header"]
)
def test_corrupt_last_record_file(
    pristine: Pristine, tmp_path: Path, where: Any, reader: list[int]
) -> None:
    d = _copy(pristine, tmp_path)
    bad = _rec(d, 9, 10)
    if where == "header":
        _flip_header_byte(bad)
    else:
        _flip_data_byte(bad, where)

    with pytest.warns(lowdiff.RecoveryWarning, match=bad.name):
        _assert_restores(d, pristine.ref, None, 9)
    for beyond in (10, 11):
        model, opt, sched = _build()
        # a damaged header is left out when the directory is scanned, damaged data when it is read
        said = (
            f"step {beyond} is not recoverable"
            if where == "header"
            else f"cannot reach step {beyond}"
        )
        with pytest.raises(lowdiff.RecoveryError, match=f"{said}.*{bad.name}"):
            lowdiff.restore(d, model, opt, sched, step=beyond)
    # steps that do not need the damaged file are untouched
    with _no_recovery_warning():
        for s in (4, 8, 9):
            _assert_restores(d, pristine.ref, s, s)
    n, problems = lowdiff.verify_dir(d)
    assert n == 8
    assert [p for p, _ in problems] == [bad]
    # a changed run id in the header no longer names one of the directory's runs
    assert ("damaged header" if where == "header" else "checksum") in problems[0][1]


def test_corrupt_newest_full_falls_back_to_older_full(pristine: Pristine, tmp_path: Path) -> None:
    d = _copy(pristine, tmp_path)
    bad = _full(d, 8)
    _flip_data_byte(bad)

    with pytest.warns(lowdiff.RecoveryWarning, match="older full checkpoint"):
        _assert_restores(d, pristine.ref, None, N_STEPS)
    for s in (8, 9, 10):
        with pytest.warns(lowdiff.RecoveryWarning, match=bad.name):
            _assert_restores(d, pristine.ref, s, s)
    with _no_recovery_warning():
        _assert_restores(d, pristine.ref, 7, 7)
    assert [p for p, _ in lowdiff.verify_dir(d)[1]] == [bad]


def test_corrupt_oldest_and_all_full_checkpoints(pristine: Pristine, tmp_path: Path) -> None:
    d = _copy(pristine, tmp_path)
    _flip_data_byte(_full(d, 0))
    model, opt, sched = _build()
    with (
        pytest.warns(lowdiff.RecoveryWarning, match="full-000000000000"),
        pytest.raises(lowdiff.RecoveryError, match=r"step 2 is not recoverable.*4\.\.11"),
    ):
        lowdiff.restore(d, model, opt, sched, step=2)
    with _no_recovery_warning():  # full 4 serves step 5; the damaged full 0 is not read
        _assert_restores(d, pristine.ref, 5, 5)

    _flip_data_byte(_full(d, 4))
    _flip_data_byte(_full(d, 8))
    model, opt, sched = _build()
    with (
        pytest.warns(lowdiff.RecoveryWarning),
        pytest.raises(lowdiff.RecoveryError, match="no usable full checkpoint"),
    ):
        lowdiff.restore(d, model, opt, sched)


def test_truncated_last_record_file(pristine: Pristine, tmp_path: Path) -> None:
    d = _copy(pristine, tmp_path)
    bad = _rec(d, 9, 10)
    _truncate(bad, 17)

    info = lowdiff.inspect_dir(d)
    assert [p for p, _ in info.problems] == [bad]
    assert info.recoverable == (0, 9)
    with pytest.warns(lowdiff.RecoveryWarning, match=bad.name):
        _assert_restores(d, pristine.ref, None, 9)
    model, opt, sched = _build()
    with (
        pytest.warns(lowdiff.RecoveryWarning),
        pytest.raises(
            lowdiff.RecoveryError, match=r"step 10 is not recoverable.*0\.\.9.*truncated"
        ),
    ):
        lowdiff.restore(d, model, opt, sched, step=10)
    problems = lowdiff.verify_dir(d)[1]
    assert [p for p, _ in problems] == [bad]
    assert "truncated" in problems[0][1]


@pytest.mark.parametrize("mode", ["header-only", "empty"])
def test_truncated_middle_record_file(
    pristine: Pristine, tmp_path: Path, mode: str, reader: list[int]
) -> None:
    d = _copy(pristine, tmp_path)
    bad = _rec(d, 3, 5)
    raw = bad.read_bytes()
    keep = 8 + struct.unpack("<Q", raw[:8])[0] if mode == "header-only" else 0
    bad.write_bytes(raw[:keep])

    with pytest.warns(lowdiff.RecoveryWarning, match=bad.name):
        _assert_restores(d, pristine.ref, None, N_STEPS)  # from full 8, not affected
    with _no_recovery_warning():  # records 3..5 cannot serve step 3
        _assert_restores(d, pristine.ref, 3, 3)
    with pytest.warns(lowdiff.RecoveryWarning, match=bad.name):  # they could serve step 4
        _assert_restores(d, pristine.ref, 4, 4)
    model, opt, sched = _build()
    with (
        pytest.warns(lowdiff.RecoveryWarning),
        pytest.raises(lowdiff.RecoveryError, match="step 5 is not recoverable"),
    ):
        lowdiff.restore(d, model, opt, sched, step=5)
    assert [p for p, _ in lowdiff.verify_dir(d)[1]] == [bad]


def test_verify_dir_names_every_bad_file(pristine: Pristine, tmp_path: Path) -> None:
    d = _copy(pristine, tmp_path)
    flipped_rec, flipped_full, cut_rec = _rec(d, 9, 10), _full(d, 4), _rec(d, 0, 2)
    _flip_data_byte(flipped_rec)
    _flip_data_byte(flipped_full, 0.9)
    _truncate(cut_rec, 1)
    n, problems = lowdiff.verify_dir(d)
    assert n == 8
    assert sorted(p for p, _ in problems) == sorted([flipped_rec, flipped_full, cut_rec])
    assert all(reason for _, reason in problems)


def test_corrupt_manifest(pristine: Pristine, tmp_path: Path) -> None:
    d = _copy(pristine, tmp_path)
    manifest = d / "lowdiff.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"batch_size": 3', '"batch_size": 4', 1))
    assert manifest.read_text() != text
    problems = lowdiff.verify_dir(d)[1]
    assert manifest in [p for p, _ in problems]
    model, opt, sched = _build()
    with pytest.raises(lowdiff.CorruptCheckpointError, match="lowdiff.json"):
        lowdiff.restore(d, model, opt, sched)


# ----------------------------------------------------------------------------- resume


def _quarantined(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (d / "quarantine").rglob("*.safetensors")}


@pytest.mark.parametrize("damaged", ["last-record", "newest-full"])
def test_resume_quarantines_damaged_file_and_continues(
    pristine: Pristine, tmp_path: Path, damaged: str
) -> None:
    d = _copy(pristine, tmp_path)
    bad, expect_start = (_rec(d, 9, 10), 9) if damaged == "last-record" else (_full(d, 8), N_STEPS)
    _flip_data_byte(bad)
    damaged_bytes = bad.read_bytes()
    # a temp file left by a killed writer is removed; it is never read
    stale = d / "records" / ".tmp-rec-000000000011-000000000013.safetensors.123.abcd1234"
    stale.write_bytes(b"half a file")

    model, opt, sched = _build(seed=99)
    ck = _checkpointer(model, opt, sched, d)
    try:
        with pytest.warns(lowdiff.RecoveryWarning) as caught:
            start = ck.resume()
        messages = [str(w.message) for w in caught]
        assert any(bad.name in m for m in messages), messages
        assert any("moved 1 file(s)" in m and "quarantine" in m for m in messages), messages
        assert start == expect_start
        assert ck.recovery_stats is not None
        assert str(bad) in [p for p, _ in ck.recovery_stats.skipped]
        assert not _diff(pristine.ref[start], state_tensors(model, opt, sched))
        # moved, not deleted, and out of the chain
        assert not bad.exists()
        assert not stale.exists()
        assert _quarantined(d) == {f"{bad.parent.name}--{bad.name}": damaged_bytes}
        _train(ck, model, opt, sched, start, REF_STEPS)
    finally:
        ck.close()
    assert not _diff(pristine.ref[REF_STEPS], state_tensors(model, opt, sched))

    assert lowdiff.verify_dir(d)[1] == []
    assert lowdiff.inspect_dir(d).recoverable == (0, REF_STEPS)
    with _no_recovery_warning():
        for s in range(REF_STEPS + 1):
            _assert_restores(d, pristine.ref, s, s)


def test_resume_quarantines_damaged_and_later_files(pristine: Pristine, tmp_path: Path) -> None:
    d = _copy(pristine, tmp_path)
    bad, later = _rec(d, 6, 8), _rec(d, 9, 10)
    _flip_data_byte(bad)
    expected = {
        f"records--{bad.name}": bad.read_bytes(),
        f"records--{later.name}": later.read_bytes(),
    }

    model, opt, sched = _build(seed=99)
    ck = _checkpointer(model, opt, sched, d)
    try:
        with pytest.warns(lowdiff.RecoveryWarning) as caught:
            start = ck.resume()
        assert any("moved 2 file(s)" in str(w.message) for w in caught)
        # full 8 is intact but record 8 is in the damaged file
        assert start == 8
        assert not _diff(pristine.ref[8], state_tensors(model, opt, sched))
        assert not bad.exists() and not later.exists()
        assert _quarantined(d) == expected
        _train(ck, model, opt, sched, start, 13)
    finally:
        ck.close()
    assert not _diff(pristine.ref[13], state_tensors(model, opt, sched))

    assert lowdiff.verify_dir(d)[1] == []
    with _no_recovery_warning():
        for s in [*range(0, 7), *range(8, 14)]:
            _assert_restores(d, pristine.ref, s, s)
    # records 6 and 7 were only in the quarantined file
    model, opt, sched = _build()
    with pytest.raises(lowdiff.RecoveryError, match="step 7 is not recoverable"):
        lowdiff.restore(d, model, opt, sched, step=7)


# ----------------------------------------------------------------------------- retention


@pytest.mark.parametrize("keep_full", [2, 1])
def test_retention_keeps_newest_fulls_and_their_records(
    tmp_path: Path, pristine: Pristine, keep_full: int
) -> None:
    n = 3 * FULL_EVERY + 1
    model, opt, sched = _build()
    ck = _checkpointer(model, opt, sched, tmp_path, keep_full=keep_full)
    try:
        assert ck.resume() == 0
        snaps = _train(ck, model, opt, sched, 0, n)
    finally:
        ck.close()
    for s in snaps:
        if s <= REF_STEPS:
            assert not _diff(pristine.ref[s], snaps[s])

    info = lowdiff.inspect_dir(tmp_path)
    kept = [FULL_EVERY * i for i in range(4 - keep_full, 4)]
    assert [f.first_step for f in info.full_checkpoints] == kept
    oldest = kept[0]
    assert all(f.last_step >= oldest for f in info.record_files)
    assert info.recoverable == (oldest, n)
    assert lowdiff.verify_dir(tmp_path)[1] == []

    with _no_recovery_warning():
        for s in range(oldest, n + 1):
            _assert_restores(tmp_path, snaps, s, s)
    for s in range(0, oldest):
        model, opt, sched = _build()
        with pytest.raises(
            lowdiff.RecoveryError, match=rf"step {s} is not recoverable.*{oldest}\.\.{n}"
        ):
            lowdiff.restore(tmp_path, model, opt, sched, step=s)
