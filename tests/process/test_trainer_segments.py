"""The named shared memory a surviving process makes for the trainer that takes it over:
slots, counters and (LowDiff's writer) a staging buffer whose pages are allocated ahead."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

from lowdiff.errors import LowDiffError
from lowdiff.proc import holder as rp
from lowdiff.proc.takeover_socket import TrainerSegments


def _names(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


@pytest.fixture
def prefix():
    p = f"lowdiff-test{uuid.uuid4().hex[:10]}"
    yield p
    for name in _names(p):
        rp.unlink_segment(name)


def _kernel_populates() -> bool:
    """Whether this kernel has ``MADV_POPULATE_WRITE`` (Linux 5.14+)."""
    shm = rp.create_segment(f"lowdiff-test{uuid.uuid4().hex[:10]}-probe", 4096)
    try:
        return rp.populate(shm)
    finally:
        rp.unlink_and_close(shm)


@pytest.mark.skipif(not _kernel_populates(), reason="no MADV_POPULATE_WRITE (Linux < 5.14)")
def test_slots_and_staging_buffer_are_made_with_their_pages_allocated(prefix):
    size = 4 << 20
    made = TrainerSegments.make(prefix, 3, 256, staging_bytes=size)
    try:
        assert made.info["staging"] == f"{prefix}-stage"
        assert made.info["staging_bytes"] == size
        assert made.staging is not None and made.staging.numel() == size
        assert _names(prefix) == sorted(f"{prefix}-{s}" for s in ("ctr", "slots", "stage"))

        # allocated on a thread from now on, not at the first writes of the trainer
        def allocated(name: str) -> int:
            return os.stat(f"/dev/shm/{prefix}-{name}").st_blocks * 512

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            allocated("stage") < size or allocated("slots") < 768
        ):
            time.sleep(0.01)
        assert allocated("stage") >= size and allocated("slots") >= 3 * 256

        # the trainer's side: another mapping of the same memory, mapped in one call
        shm = rp.attach_segment(f"{prefix}-stage")
        try:
            assert rp.populate(shm)
            theirs = rp.segment_tensor(shm, size)
            theirs[:8] = torch.arange(8, dtype=torch.uint8)
            assert torch.equal(made.staging[:8], torch.arange(8, dtype=torch.uint8))
            del theirs
        finally:
            shm.close()
    finally:
        made.unlink()
    assert _names(prefix) == []


def test_without_staging_bytes_no_staging_buffer(prefix):
    made = TrainerSegments.make(prefix, 2, 64)
    try:
        assert made.staging is None and "staging" not in made.info
        assert _names(prefix) == sorted(f"{prefix}-{s}" for s in ("ctr", "slots"))
    finally:
        made.unlink()
    assert _names(prefix) == []


def test_a_staging_buffer_that_cannot_be_made_leaves_nothing(prefix):
    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    with pytest.raises(LowDiffError, match="not enough shared memory"):
        TrainerSegments.make(prefix, 2, 64, staging_bytes=too_big)
    assert _names(prefix) == []  # the slots and counters made before it are gone


def test_a_writer_without_room_for_the_staging_buffer_still_makes_the_slots(prefix, tmp_path):
    """The writer's staging buffer for the next trainer is a convenience: when /dev/shm
    cannot hold it, the slots and counters are made without it (the trainer then makes
    its own at its first full checkpoint) instead of the takeover being refused."""
    from types import SimpleNamespace

    from lowdiff.engine.writer.main import WriterProcess

    run_id = prefix[len("lowdiff-") :] + "0" * 16
    w = SimpleNamespace(cfg=SimpleNamespace(root=str(tmp_path), run_id=run_id, row_bytes=64))
    survivor = WriterProcess(w)
    st = os.statvfs("/dev/shm")
    survivor.staging_bytes = st.f_bavail * st.f_frsize + (1 << 30)
    made = survivor.make_segments(2)
    try:
        assert made.staging is None and "staging" not in made.info
        assert made.n_slots == 2 and tuple(made.slots.shape) == (2, 64)
    finally:
        made.unlink()
    assert _names(prefix) == []

    survivor.staging_bytes = 1 << 20  # room for it: made
    made = survivor.make_segments(2)
    try:
        assert made.staging is not None and made.info["staging_bytes"] == 1 << 20
    finally:
        made.unlink()
