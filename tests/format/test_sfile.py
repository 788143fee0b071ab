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
