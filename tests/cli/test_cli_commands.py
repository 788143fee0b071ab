"""The CLI's inspect, verify and export commands, called through ``main([...])``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from tests import launch

import lowdiff
from lowdiff.cli.main import main

pytestmark = pytest.mark.multiprocess


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint directory of 9 steps, plus the live model state after every step."""
    d = tmp_path_factory.mktemp("cli") / "ck"
    m, o = _model()
    snaps = {0: {k: v.clone() for k, v in m.state_dict().items()}}
    with lowdiff.Checkpointer(
        d, m, o, compressor=lowdiff.TopK(0.3), full_every=4, records_per_file=2, keep_full=None
    ) as ck:
        ck.resume()
        for i in range(9):
            g = torch.Generator().manual_seed(i)
            m(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
            ck.step()
            o.zero_grad()
            snaps[i + 1] = {k: v.clone() for k, v in m.state_dict().items()}
    return d, snaps


def test_inspect_text_and_json(trained, capsys):
    d, _ = trained
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "recoverable  steps 0..9" in out and "full-000000000008.safetensors" in out
    assert main(["inspect", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["recoverable"] == [0, 9]
    assert [f["step"] for f in info["full_checkpoints"]] == [0, 4, 8]
    assert sum(f["records"] for f in info["record_files"]) == 9


def test_inspect_verify_leaves_a_damaged_file_out_of_the_recoverable_steps(
    trained, tmp_path, capsys
):
    """A byte flipped in a record file's data: the headers still promise every step, and
    inspect says that this is what it shows; ``--verify`` (``inspect_dir(verify=True)``)
    names the file and gives the steps recovery can really reach."""
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(trained[0], d)
    damaged = next(p for p in sorted((d / "records").glob("rec-*")) if "-000000000002-" in p.name)
    raw = bytearray(damaged.read_bytes())
    raw[-3] ^= 0x10  # in the data section: the header still parses
    damaged.write_bytes(bytes(raw))
    assert lowdiff.inspect_dir(d).recoverable_intervals == [(0, 9)]
    info = lowdiff.inspect_dir(d, verify=True)
    # records 2..3 are gone: from step 0 the chain ends at 2; steps 4..9 from full 4
    assert info.recoverable_intervals == [(0, 2), (4, 9)]
    assert [p for p, _ in info.problems] == [damaged]
    with pytest.raises(lowdiff.RecoveryError):
        m, o = _model()
        lowdiff.restore(d, m, o, step=3)
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "recoverable  steps 0..9  (by the file headers; --verify checks every byte)" in out
    assert main(["inspect", str(d), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "recoverable  steps 0..2, 4..9  (every file's checksum checked)" in out
    assert damaged.name in out
    assert main(["inspect", str(d), "--verify", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] is True and doc["recoverable_intervals"] == [[0, 2], [4, 9]]


@pytest.mark.parametrize("step", [0, 3, 4, 9, None])
def test_export_matches_live_state(trained, tmp_path, step):
    d, snaps = trained
    out = tmp_path / "model.safetensors"
    args = ["export", str(d), "--out", str(out)] + ([] if step is None else ["--step", str(step)])
    assert main(args) == 0
    got = safetensors.torch.load_file(str(out))
    want = snaps[9 if step is None else step]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_export_out_of_range_is_a_clear_error(trained, tmp_path, capsys):
    d, _ = trained
    assert main(["export", str(d), "--step", "42", "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "step 42 is not recoverable" in err and "0..9" in err


def test_verify_names_each_bad_file(trained, tmp_path, capsys):
    import shutil

    d, _ = trained
    copy = tmp_path / "copy"
    shutil.copytree(d, copy, ignore=shutil.ignore_patterns(".lowdiff*"))
    assert main(["verify", str(copy)]) == 0
    assert " 0 bad" in capsys.readouterr().out
    rec = sorted((copy / "records").iterdir())[1]
    raw = bytearray(rec.read_bytes())
    raw[-3] ^= 0xFF
    rec.write_bytes(bytes(raw))
    full = sorted((copy / "full").iterdir())[0]
    full.write_bytes(full.read_bytes()[:-10])
    assert main(["verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert rec.name in out and full.name in out and " 2 bad" in out


def test_foreign_directory_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a lowdiff checkpoint directory" in err
    assert "Use an empty or new directory" not in err  # a trainer's advice, not a reader's


def test_python_dash_m_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "lowdiff", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0
    for cmd in ("demo", "inspect", "verify", "export"):
        assert cmd in r.stdout


def test_inspect_shows_live_replica(tmp_path, capsys):
    m, o = _model()
    d = tmp_path / "plus"
    ck = lowdiff.Checkpointer(
        d, m, o, method="lowdiff+", replica=lowdiff.ReplicaOptions(persist_every=2)
    )
    try:
        ck.resume()
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            m(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
            ck.step()
            o.zero_grad()
        ck.flush()
        assert main(["inspect", str(d)]) == 0
        out = capsys.readouterr().out
        assert "live replica step 3, running" in out
        assert main(["inspect", str(d), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["live_replica"]["step"] == 3
    finally:
        ck.close()
    assert main(["inspect", str(d)]) == 0
    assert "live replica" not in capsys.readouterr().out


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_example_script_trains_and_resumes(tmp_path, strategy):
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "train_lowdiff.py"
    d = tmp_path / "ck"
    cmd = [sys.executable, str(script), "--dir", str(d), "--strategy", strategy, "--steps"]
    r = launch.run([*cmd, "40"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = launch.run([*cmd, "60"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed at step 40" in r.stdout
    assert lowdiff.inspect_dir(d).recoverable[1] == 60


def test_a_reader_that_goes_away_ends_the_cli_quietly(trained):
    """``lowdiff inspect DIR | head -1``: the CLI ends without a traceback when its reader
    closes the pipe."""
    d, _ = trained
    proc = launch.popen(
        [sys.executable, "-m", "lowdiff", "inspect", str(d), "--all"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before anything was read
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == 141, (code, err)


def test_inspect_dir_of_a_job_names_inspect_job(tmp_path):
    """A distributed job's root is not one directory's worth of files: inspect_dir says
    so and names lowdiff.inspect_job, instead of summarising nothing."""
    from lowdiff.format import layout
    from lowdiff.recovery.job_layout import job_manifest

    job = tmp_path / "job"
    (job / "rank-00000").mkdir(parents=True)
    layout.write_manifest(job, job_manifest(1, "lowdiff"))
    with pytest.raises(lowdiff.NotACheckpointDirectoryError, match="lowdiff.inspect_job"):
        lowdiff.inspect_dir(job)


def test_export_out_paths_are_checked_before_any_work(trained, tmp_path, capsys):
    """A file format never replaces a directory, a path under a file is refused, both as
    a one-line error; a missing parent directory is created, for every format."""
    d, snaps = trained
    (tmp_path / "emptyd").mkdir()
    (tmp_path / "fulld").mkdir()
    (tmp_path / "fulld" / "x").write_text("mine")
    (tmp_path / "afile").write_text("mine")
    for fmt, out, needle in [
        ("safetensors", "emptyd", "is a directory; format 'safetensors' writes one file"),
        ("torch", "emptyd", "is a directory; format 'torch' writes one file"),
        ("torch", "fulld", "is a directory; format 'torch' writes one file"),
        ("safetensors", "afile/x.safetensors", "afile is not a directory"),
        ("dcp", "afile/sub", "afile is not a directory"),
        ("dcp", "fulld", "exists and is not an empty directory"),
    ]:
        code = main(["export", str(d), "--format", fmt, "--out", str(tmp_path / out)])
        err = capsys.readouterr().err
        assert code == 2, (fmt, out, err)
        assert needle in err and "Traceback" not in err, (fmt, out, err)
    assert (tmp_path / "emptyd").is_dir() and not any((tmp_path / "emptyd").iterdir())
    assert (tmp_path / "fulld" / "x").read_text() == "mine"
    assert (tmp_path / "afile").read_text() == "mine"
    for fmt, out in [("safetensors", "new/a/x.safetensors"), ("torch", "new/b/x.pt")]:
        assert main(["export", str(d), "--format", fmt, "--out", str(tmp_path / out)]) == 0
    got = safetensors.torch.load_file(str(tmp_path / "new/a/x.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in snaps[9].items())
    assert torch.load(tmp_path / "new/b/x.pt")["step"] == 9


class _Unreachable:
    """An fsspec file system whose every read fails as a client's connection error does."""

    protocol = "lowdifftestdown"

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def _strip_protocol(cls, path):
        return str(path).split("://", 1)[-1]

    @staticmethod
    def _get_kwargs_from_urls(path):
        return {}

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise ConnectionRefusedError(f"endpoint down ({name})")

        return fail


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_an_unreachable_remote_tier_is_a_one_line_error(tmp_path, capsys, command):
    fsspec = pytest.importorskip("fsspec")
    fsspec.register_implementation(_Unreachable.protocol, _Unreachable, clobber=True)
    extra = ["--out", str(tmp_path / "o.safetensors")] if command == "export" else []
    code = main([command, f"{_Unreachable.protocol}://bucket/run", *extra])
    err = capsys.readouterr().err
    assert code == 2, err  # verify's 1 means "bad files found": not this
    assert f"lowdiff {command}: error: cannot read the remote tier" in err, err
    assert "ConnectionRefusedError: endpoint down" in err and "Traceback" not in err, err


def test_records_that_is_a_file_is_named(trained, tmp_path, capsys):
    import shutil

    d, _ = trained
    copy = tmp_path / "copy"
    shutil.copytree(d, copy, ignore=shutil.ignore_patterns(".lowdiff*"))
    shutil.rmtree(copy / "records")
    (copy / "records").write_text("not a directory")
    assert main(["verify", str(copy)]) == 1
    assert "records is not a directory" in capsys.readouterr().out
    assert main(["inspect", str(copy)]) == 0
    assert "records is not a directory" in capsys.readouterr().out


def test_an_unwritable_standard_output_is_a_one_line_error(trained):
    """``lowdiff inspect DIR > /dev/full``: the write error, named, no traceback."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    d, _ = trained
    with open("/dev/full", "w") as full:
        r = launch.run(
            [sys.executable, "-m", "lowdiff", "inspect", str(d), "--all"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "No space left on device" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_demo_storage_figures_leave_out_the_step0_full_checkpoint(trained):
    """The step-0 full checkpoint holds no optimizer state: 'bytes per full checkpoint'
    is the size of the later ones, as ``lowdiff inspect`` gives it."""
    from lowdiff_lab.demo.analysis import storage_stats

    d, _ = trained
    info = lowdiff.inspect_dir(d)
    sizes = {f.first_step: f.nbytes for f in info.full_checkpoints}
    assert 0 in sizes and len(sizes) >= 2 and sizes[0] < min(v for k, v in sizes.items() if k)
    later = [v for k, v in sizes.items() if k > 0]
    got = storage_stats(d, n_params=sum(p.numel() for p in _model()[0].parameters()), compressor={})
    assert got["bytes_per_full"] == sum(later) / len(later) == info.bytes_per_full
    assert got["full_checkpoints"] == len(sizes)


_KILLED_TRAINER = """
import os, signal, sys, torch, lowdiff
torch.manual_seed(0)
m = torch.nn.Linear(6, 3)
o = torch.optim.Adam(m.parameters(), lr=1e-2)
ck = lowdiff.Checkpointer(m, o, sys.argv[1], compressor=lowdiff.TopK(0.5), full_every=4)
ck.resume()
for i in range(6):
    m(torch.randn(5, 6)).pow(2).mean().backward()
    ck.step()
    o.zero_grad()
ck.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_inspect_names_a_writer_live_and_left_over(tmp_path, capsys):
    """The writer that outlived its trainer is a 'live writer'; once it is gone too, a
    'left-over writer' (not a 'live replica')."""
    import os
    import signal
    import time

    from lowdiff.proc.holder import replica_status

    d = tmp_path / "ck"
    r = launch.run(
        [sys.executable, "-c", _KILLED_TRAINER, str(d)], capture_output=True, timeout=300
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    status = replica_status(d)
    assert status is not None and status["process"] == "writer", status
    assert main(["inspect", str(d)]) == 0
    assert "live writer step 6, " in capsys.readouterr().out
    os.kill(status["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (replica_status(d) or {}).get("state") != "stale (owner gone)":
        assert time.monotonic() < deadline, replica_status(d)
        time.sleep(0.05)
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "left-over writer" in out and "stale (owner gone)" in out and "replica" not in out, out
    # the next trainer clears what the dead writer left (its shared memory, descriptor)
    m = torch.nn.Linear(6, 3)
    with lowdiff.Checkpointer(
        d, m, torch.optim.Adam(m.parameters(), lr=1e-2), compressor=lowdiff.TopK(0.5), full_every=4
    ) as ck:
        assert ck.resume() == 6
    assert replica_status(d) is None
