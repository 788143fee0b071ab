"""Hypothesis against the readers: any input gives a clean error or a valid parse."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import codec, layout, sfile
from lowdiff_lab.torture.fuzz import run_fuzz, seed_inputs
from lowdiff_lab.torture.report import TortureReport

SEEDS = seed_inputs()
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
_count = [0]


@pytest.fixture(scope="module", autouse=True)
def _tally(torture_report):
    _count[0] = 0
    yield
    torture_report.fuzz_inputs += _count[0]
    torture_report.fuzz_clean_errors += _count[0]  # each test fails on anything unclean


def _file_result(path: Path, data: bytes) -> None:
    _count[0] += 1
    path.write_bytes(data)
    try:
        hdr = sfile.read_header(path)
        lf = sfile.decode(path, bytearray(data))
    except CorruptCheckpointError as e:
        assert e.path == path and e.reason
        return
    # a valid parse is self-consistent: nothing is read beyond the file
    assert hdr.file_size == len(data)
    assert sum(t.numel() * t.element_size() for t in lf.tensors.values()) <= len(data)


@FUZZ
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes(tmp_path, data) -> None:
    _file_result(tmp_path / "x.safetensors", data)


@FUZZ
@given(
    which=st.sampled_from(range(len(SEEDS["file"]))),
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.none() | st.integers(0, 1 << 16),
)
def test_mutated_lowdiff_files(tmp_path, which, edits, cut) -> None:
    b = bytearray(SEEDS["file"][which])
    for at, value in edits:
        b[at % len(b)] = value
    if cut is not None:
        del b[cut % (len(b) + 1) :]
    _file_result(tmp_path / "x.safetensors", bytes(b))


_numbers = st.one_of(
    st.integers(-5, 1 << 64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.none(),
)


@FUZZ
@given(
    shapes=st.lists(st.lists(_numbers, max_size=3), max_size=3),
    offsets=st.lists(st.lists(_numbers, max_size=3), max_size=3),
    dtype=st.sampled_from(["F32", "U8", "I64", "BF16", "F8_E4M3", "nope", ""]),
    length=st.none() | st.integers(0, 1 << 63),
    data=st.binary(max_size=64),
)
def test_forged_headers(tmp_path, shapes, offsets, dtype, length, data) -> None:
    header: dict = {"__metadata__": {"format": "lowdiff", "format_version": "1", "xxh3": "0" * 16}}
    for i, (shape, off) in enumerate(zip(shapes, offsets, strict=False)):
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": off}
    raw = json.dumps(header).encode()
    n = len(raw) if length is None else length
    _file_result(tmp_path / "x.safetensors", struct.pack("<Q", n) + raw + data)


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(0, 255)), max_size=3),
    cut=st.none() | st.integers(0, 1 << 12),
    junk=st.none() | st.binary(max_size=64),
)
def test_manifest_reader(tmp_path, edits, cut, junk) -> None:
    _count[0] += 1
    b = bytearray(SEEDS["manifest"][0] if junk is None else junk)
    for at, value in edits:
        if b:
            b[at % len(b)] = value
    if cut is not None:
        del b[cut % (len(b) + 1) :]
    (tmp_path / layout.MANIFEST).write_bytes(bytes(b))
    try:
        body = layout.read_manifest(tmp_path)
    except CorruptCheckpointError as e:
        assert e.path.name == layout.MANIFEST
        return
    assert isinstance(body, dict)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "__tuple__",
                    "__dict__",
                    "__float__",
                    "__tensor__",
                    "__tensor_ref__",
                    "__str_dict__",
                ]
                + ["dtype", "shape", "b64", "a", "step"]
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=20,
)


@FUZZ
@given(tree=_json)
def test_metadata_decoder(tree) -> None:
    _count[0] += 1
    with contextlib.suppress(ValueError):
        codec.loads(json.dumps(tree), lambda name: torch.zeros(1))


def test_deeply_nested_metadata_is_a_clean_error() -> None:
    _count[0] += 1
    with pytest.raises(ValueError, match="malformed"):
        codec.loads("[" * 100000 + "]" * 100000)


def test_forged_inline_tensor_shape_allocates_nothing() -> None:
    _count[0] += 1
    doc = json.dumps({"__tensor__": {"dtype": "F32", "shape": [1 << 40], "b64": ""}})
    with pytest.raises(ValueError, match="cannot hold 0 bytes"):
        codec.loads(doc)


def test_builtin_fuzzer_finds_no_crash(torture_report) -> None:
    report = TortureReport()
    run_fuzz(report, inputs=600, seed=11)
    torture_report.merge(report)
    assert report.failures == [] and report.fuzz_crashes == 0
    assert report.fuzz_clean_errors > 0 and report.fuzz_valid_parses > 0
