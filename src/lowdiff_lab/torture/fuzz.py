"""Fuzzing the readers of records, full checkpoints, the manifest and metadata documents.

A small mutational fuzzer (no dependency beyond the standard library): it starts from
valid files and documents, then flips, inserts, deletes and overwrites bytes, forges the
length prefix and the header's shapes, offsets and dtypes, and forges metadata
documents. Every input must give a clean error (:class:`CorruptCheckpointError` from the
file and manifest readers, ``ValueError`` from the metadata decoder) or a valid parse;
anything else, or an input that takes more than a second, counts as a crash. The test
suite runs the same readers under Hypothesis.
"""

from __future__ import annotations

import functools
import json
import random
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import codec, layout, sfile
from lowdiff_lab.torture.report import TortureReport

SLOW_S = 1.0


def seed_inputs() -> dict[str, list[bytes]]:
    """Valid inputs to mutate: lowdiff files, manifests and metadata documents."""
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "x.safetensors"
        files = []
        for tensors, meta in (
            ({"records": torch.arange(96, dtype=torch.uint8).view(3, 32)}, {"kind": "records"}),
            (
                {
                    "model/w": torch.randn(4, 5),
                    "model/b": torch.zeros(5, dtype=torch.float64),
                    "rng.cpu": torch.arange(7, dtype=torch.uint8),
                    "i": torch.tensor([1, 2], dtype=torch.int16),
                },
                {"kind": "full", "step": "8", "optim": '{"state":{}}'},
            ),
        ):
            sfile.write_tensors(p, tensors, meta)
            files.append(p.read_bytes())
        layout.write_manifest(Path(tmp), {"format": "lowdiff", "n": [1, 2.5, None], "s": "x"})
        manifest = (Path(tmp) / layout.MANIFEST).read_bytes()
    docs = [
        codec.dumps(
            {
                "step": 3,
                "hp": [{"lr": 0.1, "betas": (0.9, 0.99)}],
                "state": {0: {"t": torch.arange(3.0)}},
                "inf": float("inf"),
            }
        ).encode()
    ]
    return {"file": files, "manifest": [manifest], "doc": docs}


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four random edits of ``data``."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        i = rng.randrange(len(b)) if b else 0
        if op == 0 and b:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[i] = rng.randrange(256)
        elif op == 2:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and b:
            del b[i : i + rng.randint(1, 16)]
        elif op == 4:
            del b[rng.randrange(len(b) + 1) :]
        elif op == 5 and len(b) >= 8:
            # forge the length prefix
            n = rng.choice([0, 1, len(b), len(b) - 8, 1 << 31, 1 << 62, rng.randrange(1 << 20)])
            b[:8] = struct.pack("<Q", n)
        elif op == 6:
            b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return bytes(b)


def forge_header(rng: random.Random) -> bytes:
    """A structurally plausible lowdiff file whose header lies about its tensors."""
    big = [1 << 40, 1 << 62, -1, 10**30, 3, 0, 2.5, "7", None, [1], 1e308, float("inf")]
    entries: dict[str, Any] = {
        "__metadata__": {"format": "lowdiff", "format_version": "1", "xxh3": "0" * 16}
    }
    for k in range(rng.randint(0, 3)):
        entries[f"t{k}"] = {
            "dtype": rng.choice(["F32", "U8", "I64", "BF16", "XX", 5]),
            "shape": [rng.choice(big) for _ in range(rng.randint(0, 3))],
            "data_offsets": [rng.choice(big), rng.choice(big)],
        }
    raw = json.dumps(entries).encode()
    data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    return struct.pack("<Q", len(raw)) + raw + data


def forge_doc(rng: random.Random, depth: int = 0) -> Any:
    """A JSON tree using (and misusing) the codec's tags."""
    tags = [
        lambda: {
            "__tensor__": {"dtype": "F32", "shape": [rng.choice([1 << 40, -3, 2])], "b64": ""}
        },
        lambda: {"__tensor__": {"dtype": "F64", "shape": [1], "b64": "AAAAAAAA8D8="}},
        lambda: {"__tensor__": {"dtype": "nope", "shape": "x", "b64": 3}},
        lambda: {"__float__": rng.choice(["nan", "inf", "bad", 3])},
        lambda: {"__dict__": rng.choice([[[1, 2]], [[[1], 2]], "x", [[{"a": 1}, 2]]])},
        lambda: {"__tuple__": rng.choice([[1, 2], "ab", 5])},
        lambda: {"__tensor_ref__": "missing"},
        lambda: {"__str_dict__": rng.choice([[["a", 1]], [[1, 2]], 7])},
    ]
    if depth > 3 or rng.random() < 0.3:
        return rng.choice([0, 1.5, "s", None, True, *[t() for t in tags[:2]]])
    if rng.random() < 0.5:
        return rng.choice(tags)()
    if rng.random() < 0.5:
        return [forge_doc(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": forge_doc(rng, depth + 1) for i in range(rng.randint(0, 3))}


def classify_file(path: Path, data: bytes) -> str:
    """ "clean", "valid" or "crash: ..." for the file readers."""
    path.write_bytes(data)
    try:
        sfile.read_header(path)
        sfile.read(path)
        sfile.decode(path, bytearray(data))
        return "valid"
    except CorruptCheckpointError:
        return "clean"
    except Exception as e:  # noqa: BLE001 -- anything else is a finding
        return f"crash: {type(e).__name__}: {e}"


def classify_manifest(root: Path, data: bytes) -> str:
    (root / layout.MANIFEST).write_bytes(data)
    try:
        layout.read_manifest(root)
        return "valid"
    except CorruptCheckpointError:
        return "clean"
    except Exception as e:  # noqa: BLE001
        return f"crash: {type(e).__name__}: {e}"


def classify_doc(data: bytes) -> str:
    try:
        codec.loads(data.decode("utf-8", errors="replace"), lambda name: torch.zeros(1))
        return "valid"
    except ValueError:
        return "clean"
    except Exception as e:  # noqa: BLE001
        return f"crash: {type(e).__name__}: {e}"


def run_fuzz(
    report: TortureReport,
    *,
    inputs: int = 2000,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> None:
    """Feed ``inputs`` generated inputs to the readers and count the outcomes."""
    rng = random.Random(seed)
    seeds = seed_inputs()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "fuzz.safetensors"
        for i in range(inputs):
            which = i % 6
            check: Callable[[bytes], str]
            if which in (0, 1):
                data = mutate(rng.choice(seeds["file"]), rng)
                check = functools.partial(classify_file, path)
            elif which == 2:
                data = forge_header(rng)
                check = functools.partial(classify_file, path)
            elif which == 3:
                data = mutate(seeds["manifest"][0], rng)
                check = functools.partial(classify_manifest, root)
            elif which == 4:
                data = mutate(seeds["doc"][0], rng)
                check = classify_doc
            else:
                data = json.dumps(forge_doc(rng)).encode()
                check = classify_doc
            result = _timed(check, data)
            report.fuzz_inputs += 1
            if result == "clean":
                report.fuzz_clean_errors += 1
            elif result == "valid":
                report.fuzz_valid_parses += 1
            else:
                report.fuzz_crashes += 1
                report.fail(f"fuzz input {data[:80]!r}...: {result}")
    if log:
        log(f"fuzz: {report.fuzz_inputs} inputs")


def _timed(fn: Callable[[bytes], str], data: bytes) -> str:
    t0 = time.perf_counter()
    result = fn(data)
    took = time.perf_counter() - t0
    if took > SLOW_S:
        return f"crash: took {took:.1f} s ({result})"
    return result
