from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import sfile


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),
        "idx": torch.randint(0, 60000, (7,), generator=g, dtype=torch.int32).to(torch.uint16),
        "d": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0),
        "half": torch.randn(4, generator=g).bfloat16(),
        "codes": torch.randint(-127, 127, (9,), generator=g, dtype=torch.int8),
    }


def test_round_trip_and_official_reader(tmp_path):
    t = _tensors()
    path = tmp_path / "x.safetensors"
    n = sfile.write_tensors(path, t, {"kind": "full", "step": "3"})
    assert n == path.stat().st_size
    loaded = sfile.read(path)
    assert loaded.metadata["kind"] == "full" and loaded.metadata["step"] == "3"
    assert loaded.metadata["format"] == "lowdiff"
    assert set(loaded.tensors) == set(t)
    for k, v in t.items():
        assert torch.equal(loaded.tensors[k], v), k
    # any safetensors reader can open lowdiff files
    official = safetensors.torch.load_file(str(path))
    for k, v in t.items():
        assert torch.equal(official[k], v), k


def test_layout_is_aligned_and_contiguous():
    entries, size = sfile.plan(
        [
            ("a", torch.uint8, (3,)),
            ("b", torch.float64, (2,)),
            ("c", torch.int16, (5,)),
            ("d", torch.float32, (1,)),
        ]
    )
    assert [e.name for e in entries] == ["b", "d", "c", "a"]
    pos = 0
    for e in entries:
        assert e.start == pos and e.start % torch.empty((), dtype=e.dtype).element_size() == 0
        pos = e.end
    assert pos == size


def test_every_flipped_byte_and_every_truncation_is_detected(tmp_path):
    path = tmp_path / "x.safetensors"
    sfile.write_tensors(path, _tensors(), {"kind": "records"})
    raw = bytearray(path.read_bytes())
    undetected = []
    for i in range(len(raw)):
        for mask in (0x01, 0x20, 0x80):
            bad = bytearray(raw)
            bad[i] ^= mask
            try:
                sfile.decode(path, bad)
                undetected.append((i, mask))
            except CorruptCheckpointError:
                pass
    for cut in range(len(raw)):
        with pytest.raises(CorruptCheckpointError):
            sfile.decode(path, bytearray(raw[:cut]))
    assert undetected == []


def test_appended_bytes_are_detected(tmp_path):
    path = tmp_path / "x.safetensors"
    sfile.write_tensors(path, _tensors(), {"kind": "full"})
    with pytest.raises(CorruptCheckpointError, match="data section"):
        sfile.decode(path, bytearray(path.read_bytes() + b"\0"))


def test_foreign_safetensors_file_is_rejected_by_name(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(3)}, str(path))
    with pytest.raises(CorruptCheckpointError) as e:
        sfile.read(path)
    assert "model.safetensors" in str(e.value) and "lowdiff" in str(e.value)


def test_forged_length_field_does_not_allocate(tmp_path):
    path = tmp_path / "forged.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="header length"):
        sfile.read_header(path)
    with pytest.raises(CorruptCheckpointError):
        sfile.read(path)


def test_newer_format_version_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    header = {"__metadata__": {"format": "lowdiff", "format_version": "99", "xxh3": "0" * 16}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptCheckpointError, match="newer"):
        sfile.read_header(path)


def test_atomic_write_leaves_no_partial_file(tmp_path):
    from lowdiff.format import atomic

    target = tmp_path / "x.bin"

    def boom(_path):
        raise OSError("injected failure before rename")

    atomic.set_fault_hook("before_rename", boom)
    try:
        with pytest.raises(OSError, match="injected"):
            atomic.write_bytes_atomic(target, b"payload")
    finally:
        atomic.set_fault_hook("before_rename", None)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------- O_DIRECT writes


def _direct_supported(directory) -> bool:
    import os

    probe = directory / "probe"
    probe.touch()
    try:
        fd = os.open(probe, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    finally:
        probe.unlink()
    os.close(fd)
    return hasattr(os, "O_DIRECT")


def _aligned_blob(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    blob = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).share_memory_()
    assert blob.data_ptr() % sfile.DIRECT_ALIGN == 0  # shared memory is page-aligned
    return blob


def _data_offset(path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize(
    "extra", [0, 1, 4095, 12345], ids=["whole-pages", "one-byte-tail", "page-less-one", "tail"]
)
@pytest.mark.parametrize("with_progress", [False, True], ids=["plain", "progress"])
def test_direct_write_round_trip(tmp_path, monkeypatch, extra, with_progress):
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(sfile, "WRITE_CHUNK", 1 << 20)  # several chunks
    used: list[bool] = []
    real = sfile._write_direct

    def spy(*a, **k):
        used.append(real(*a, **k))
        return used[-1]

    monkeypatch.setattr(sfile, "_write_direct", spy)
    nbytes = sfile.DIRECT_MIN_BYTES + 2 * sfile.DIRECT_ALIGN + extra
    blob = _aligned_blob(nbytes)
    entries = [sfile.TensorEntry("x", torch.uint8, (nbytes,), 0, nbytes)]
    seen: list[int] = []
    path = tmp_path / "full.safetensors"
    n = sfile.write(
        path, entries, blob, {"kind": "full"}, direct=True,
        progress=seen.append if with_progress else None,
    )  # fmt: skip
    assert used == [True]  # the O_DIRECT path wrote it
    assert n == path.stat().st_size == _data_offset(path) + nbytes
    assert _data_offset(path) % sfile.DIRECT_ALIGN == 0
    if with_progress:
        assert seen and seen == sorted(seen) and seen[-1] == nbytes and len(seen) >= 2
    loaded = sfile.read(path)
    assert torch.equal(loaded.tensors["x"], blob)
    assert torch.equal(safetensors.torch.load_file(str(path))["x"], blob)
    # the whole-file checksum covers the padding too
    raw = bytearray(path.read_bytes())
    raw[_data_offset(path) - 1] = ord("x")
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        sfile.read(path)


def test_direct_write_falls_back_where_not_possible(tmp_path, monkeypatch):
    import errno
    import os

    nbytes = sfile.DIRECT_MIN_BYTES + 100
    blob = _aligned_blob(nbytes + 1)
    calls: list[str] = []
    real = sfile._write_direct

    def spy(*a, **k):
        calls.append("direct")
        return real(*a, **k)

    monkeypatch.setattr(sfile, "_write_direct", spy)

    def check(path, data):
        assert torch.equal(sfile.read(path).tensors["x"], data)
        assert _data_offset(path) % 8 == 0

    # memory not page-aligned, a small file, or direct not asked for: buffered
    for i, (data, direct) in enumerate(
        [(blob[1:], True), (blob[: sfile.DIRECT_MIN_BYTES - 1], True), (blob[:nbytes], False)]
    ):
        path = tmp_path / f"b{i}.safetensors"
        e = [sfile.TensorEntry("x", torch.uint8, (data.numel(),), 0, data.numel())]
        sfile.write(path, e, data, {"kind": "full"}, direct=direct)
        check(path, data)
    assert calls == []
    # the file system refuses O_DIRECT at open, or at the first write: buffered, same bytes
    data = blob[:nbytes]
    e = [sfile.TensorEntry("x", torch.uint8, (nbytes,), 0, nbytes)]
    real_open, real_writev = os.open, os.writev

    def refuse_open(p, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(p, flags, *a)

    monkeypatch.setattr(sfile.os, "open", refuse_open)
    sfile.write(tmp_path / "c.safetensors", e, data, {"kind": "full"}, direct=True)
    monkeypatch.setattr(sfile.os, "open", real_open)
    assert sfile.read(tmp_path / "c.safetensors").tensors["x"].equal(data)

    refused: list[int] = []

    def refuse_first_write(fd, bufs):
        if not refused:  # the O_DIRECT header write; the buffered retry goes through
            refused.append(fd)
            raise OSError(errno.EINVAL, "unaligned")
        return real_writev(fd, bufs)

    monkeypatch.setattr(sfile.os, "writev", refuse_first_write)
    sfile.write(tmp_path / "d.safetensors", e, data, {"kind": "full"}, direct=True)
    monkeypatch.setattr(sfile.os, "writev", real_writev)
    assert len(refused) == 1
    assert sfile.read(tmp_path / "d.safetensors").tensors["x"].equal(data)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "b0.safetensors", "b1.safetensors", "b2.safetensors", "c.safetensors", "d.safetensors"
    ]  # fmt: skip


def test_direct_write_error_other_than_einval_is_raised_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    nbytes = sfile.DIRECT_MIN_BYTES
    blob = _aligned_blob(nbytes)
    e = [sfile.TensorEntry("x", torch.uint8, (nbytes,), 0, nbytes)]

    def full_disk(fd, bufs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sfile.os, "writev", full_disk)
    with pytest.raises(OSError, match="No space") as info:
        sfile.write(tmp_path / "x.safetensors", e, blob, {"kind": "full"}, direct=True)
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_aligned_empty_is_page_aligned_and_written_directly(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    used: list[bool] = []
    real = sfile._write_direct
    monkeypatch.setattr(
        sfile, "_write_direct", lambda *a, **k: used.append(real(*a, **k)) or used[-1]
    )
    nbytes = sfile.DIRECT_MIN_BYTES + 3
    buf = sfile.aligned_empty(nbytes + 100)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes + 100
    assert buf.data_ptr() % sfile.DIRECT_ALIGN == 0
    buf.copy_(_aligned_blob(nbytes + 100, seed=3))
    data = buf[:nbytes]
    e = [sfile.TensorEntry("x", torch.uint8, (nbytes,), 0, nbytes)]
    sfile.write(tmp_path / "x.safetensors", e, data, {"kind": "full"}, direct=True)
    assert used == [True]
    assert torch.equal(sfile.read(tmp_path / "x.safetensors").tensors["x"], data)
    assert sfile.aligned_empty(0).numel() == 0
