"""strategy="torch-save": synchronous full checkpoints, exact recovery, damaged files named."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from tests.baselines import harness

import lowdiff
from lowdiff_lab.baselines import BaselineCheckpointer


def test_same_constructor_returns_the_baseline(tmp_path: Path) -> None:
    model, opt, _ = harness.build()
    ck = lowdiff.Checkpointer(tmp_path / "c", model, opt, method="torch-save", full_every=2)
    assert isinstance(ck, lowdiff.Checkpointer) and ck.method == "torch-save"
    assert isinstance(ck.strategy_impl, BaselineCheckpointer)
    ck.close()


def test_resume_is_exact(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    harness.run(d, 0, 7, strategy="torch-save", full_every=3)
    ck, objects, resumed = harness.run(d, 0, 6, strategy="torch-save", full_every=3, close=False)
    assert resumed == 6  # the newest checkpoint (steps 0, 3, 6); step 7 was never saved
    assert ck.recovery_stats is not None and ck.recovery_stats.bytes_read > 0
    ck.close()
    harness.assert_exact(harness.reference(6), objects)


def test_continuing_after_resume_matches_uninterrupted(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    harness.run(d, 0, 4, strategy="torch-save", full_every=2)
    _, objects, resumed = harness.run(d, 4, 9, strategy="torch-save", full_every=2)
    assert resumed == 4
    harness.assert_exact(harness.reference(9), objects)


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-commit"])
def test_damaged_newest_falls_back_with_a_warning(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "ckpt"
    harness.run(d, 0, 4, strategy="torch-save", full_every=2, keep_full=None)
    newest = d / "full" / "ckpt-000000000004.pt"
    raw = bytearray(newest.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x10
        newest.write_bytes(bytes(raw))
    elif damage == "truncate":
        newest.write_bytes(bytes(raw[: len(raw) // 3]))
    else:
        (d / "full" / "ckpt-000000000004.pt.commit").unlink()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ck, objects, resumed = harness.run(
            d, 0, 2, strategy="torch-save", full_every=2, close=False
        )
    assert resumed == 2
    assert any(
        issubclass(x.category, lowdiff.RecoveryWarning) and "ckpt-000000000004" in str(x.message)
        for x in w
    )
    assert any((d / "quarantine").iterdir())
    ck.close()
    harness.assert_exact(harness.reference(2), objects)


def test_other_strategy_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    harness.run(d, 0, 2, strategy="torch-save", full_every=2)
    model, opt, _ = harness.build()
    with pytest.raises(lowdiff.CheckpointMismatchError, match="torch-save"):
        lowdiff.Checkpointer(
            d, model, opt, method="lowdiff", compressor=lowdiff.TopK(ratio=0.01)
        ).resume()


def test_bad_options(tmp_path: Path) -> None:
    model, opt, _ = harness.build()
    with pytest.raises(TypeError, match="batch_size"):
        lowdiff.Checkpointer(
            tmp_path / "a", model, opt, method="torch-save", method_options={"batch_size": 3}
        )
    with pytest.raises(ValueError, match="full_every"):
        lowdiff.Checkpointer(tmp_path / "b", model, opt, method="torch-save", full_every=0)
    with pytest.raises(ValueError, match="checkfreq"):
        lowdiff.Checkpointer(tmp_path / "c", model, opt, method="bogus")


def test_retention_keeps_newest(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    harness.run(d, 0, 8, strategy="torch-save", full_every=2, keep_full=2)
    names = sorted(p.name for p in (d / "full").iterdir())
    assert names == [
        "ckpt-000000000006.pt",
        "ckpt-000000000006.pt.commit",
        "ckpt-000000000008.pt",
        "ckpt-000000000008.pt.commit",
    ]


def test_cli_verify_and_inspect_a_baseline_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowdiff.cli.main import main

    d = tmp_path / "ckpt"
    harness.run(d, 0, 4, strategy="torch-save", full_every=2)
    assert main(["verify", str(d)]) == 0
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "torch-save" in out and "ckpt-000000000004.pt" in out
    newest = d / "full" / "ckpt-000000000004.pt"
    raw = bytearray(newest.read_bytes())
    raw[100] ^= 1
    newest.write_bytes(bytes(raw))
    (d / "full" / "ckpt-000000000002.pt").unlink()
    assert main(["verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert "ckpt-000000000004.pt: checksum mismatch" in out
    assert "ckpt-000000000002.pt.commit: commit file of a checkpoint that is missing" in out


def test_a_pickle_with_code_is_refused_even_with_a_matching_digest(tmp_path: Path) -> None:
    """Someone who rewrites both the file and its commit still cannot run code at resume."""
    import json
    import os
    import pickle

    import xxhash

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    d = tmp_path / "ckpt"
    harness.run(d, 0, 2, strategy="torch-save", full_every=2, keep_full=None)
    newest = d / "full" / "ckpt-000000000002.pt"
    raw = pickle.dumps({"step": 2, "model": Evil()})
    newest.write_bytes(raw)
    commit = {
        "file": newest.name,
        "step": 2,
        "bytes": len(raw),
        "xxh3_128": xxhash.xxh3_128_hexdigest(raw),
    }
    (d / "full" / "ckpt-000000000002.pt.commit").write_text(json.dumps(commit))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ck, objects, resumed = harness.run(
            d, 0, 0, strategy="torch-save", full_every=2, close=False
        )
    assert resumed == 0 and not (tmp_path / "pwned").exists()
    assert any(
        "ckpt-000000000002.pt" in str(x.message) and "not a loadable checkpoint" in str(x.message)
        for x in w
    )
    ck.close()
