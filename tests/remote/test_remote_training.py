"""Training with a remote tier: durability per tier, recovery on a new node, faults."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.remote import RemoteStore, fetch
from lowdiff.state.capture import diff_states

from .common import Counter, train_state
from .conftest import Backend, MotoServer, new_bucket

pytestmark = pytest.mark.multiprocess

F, B = 4, 3


def _build(seed: int, width: int = 8) -> tuple[nn.Module, Any, Any, Counter]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(width, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s = torch.optim.lr_scheduler.StepLR(o, 3, 0.5)
    return m, o, s, Counter()


def _ck(
    m: nn.Module, o: Any, s: Any, c: Counter, local: Path, backend: Backend, **kw: Any
) -> lowdiff.Checkpointer:
    # generous: a wait that succeeds ends early; the fault tests set their own
    kw.setdefault("remote_timeout", 60)
    return lowdiff.Checkpointer(
        m, o, local, scheduler=s, extra_state={"data": c}, full_every=F, batch_size=B,
        remote=backend.url, remote_options=backend.options, **kw,
    )  # fmt: skip


def _train(ck: lowdiff.Checkpointer, m: nn.Module, c: Counter, start: int, stop: int) -> None:
    width = m[0].in_features
    for t in range(start, stop):
        g = torch.Generator().manual_seed(100 + t)
        c.pos += 1
        c.seen[t % 3] += 1
        ((m(torch.randn(6, width, generator=g)) - 1) ** 2).mean().backward()
        ck.step()
        ck.optimizer.zero_grad()


def test_every_step_reaches_the_remote_and_a_new_node_recovers_it(
    backend: Backend, tmp_path: Path
) -> None:
    m, o, s, c = _build(0)
    ck = _ck(m, o, s, c, tmp_path / "local", backend)
    assert ck.resume() == 0
    _train(ck, m, c, 0, 10)
    assert ck.flush(remote=True) == 10 == ck.remote_durable_step == ck.durable_step
    _train(ck, m, c, 10, 11)
    ck.close()
    assert ck.remote_durable_step == ck.durable_step == 11
    assert ck.stats["remote_errors"] == 0 and ck.stats["remote_files"] >= 5
    want = train_state(m, o, s, c)

    # on the same node: the local tier
    m1, o1, s1, c1 = _build(1)
    assert lowdiff.restore(tmp_path / "local", m1, o1, s1, extra_state={"data": c1}) == 11
    local = train_state(m1, o1, s1, c1)
    assert diff_states(want, local) == []

    # a new node: the local directory is gone; only the newest chain is downloaded
    shutil.rmtree(tmp_path / "local")
    m2, o2, s2, c2 = _build(2)
    ck2 = _ck(m2, o2, s2, c2, tmp_path / "local", backend)
    assert ck2.resume() == 11
    assert diff_states(local, train_state(m2, o2, s2, c2)) == []
    fulls = sorted(p.name for p in (tmp_path / "local" / "full").glob("*.safetensors"))
    assert fulls == ["full-000000000008.safetensors"]  # one full checkpoint fetched
    _train(ck2, m2, c2, 11, 13)  # training goes on, and so do the uploads
    assert ck2.flush(remote=True) == 13
    ck2.close()


def test_a_partial_newest_full_checkpoint_falls_back_to_an_older_one(
    backend: Backend, tmp_path: Path
) -> None:
    m, o, s, c = _build(0)
    ck = _ck(m, o, s, c, tmp_path / "local", backend, keep_full=None)
    ck.resume()
    _train(ck, m, c, 0, 10)
    ck.close()
    want = train_state(m, o, s, c)
    store = RemoteStore(backend.url, backend.options)
    newest = store.read_commit("full/full-000000000008.safetensors")
    data = store.fs.cat_file(store.key(newest.object))
    store.fs.pipe_file(store.key(newest.object), data[: len(data) // 2])  # a partial object
    with pytest.warns(
        lowdiff.RecoveryWarning, match=r"full-000000000008\.safetensors\.[0-9a-f]+: .*truncated"
    ):
        got = fetch(backend.url, tmp_path / "new", backend.options)
    assert "full/full-000000000004.safetensors" in got.files
    assert "full/full-000000000008.safetensors" not in got.files
    m2, o2, s2, c2 = _build(2)
    assert lowdiff.restore(tmp_path / "new", m2, o2, s2, extra_state={"data": c2}) == 10
    assert diff_states(want, train_state(m2, o2, s2, c2)) == []


def test_unreachable_endpoint_loses_no_local_step_and_fails_clearly(tmp_path: Path) -> None:
    pytest.importorskip("s3fs", reason="an s3:// endpoint needs s3fs")
    backend = Backend(
        "s3",
        "s3://nobucket/run",
        {
            "key": "k",
            "secret": "s",
            "endpoint_url": "http://127.0.0.1:9",  # discard port: nothing listens
            "config_kwargs": {"connect_timeout": 0.5, "retries": {"max_attempts": 1}},
        },
    )
    m, o, s, c = _build(0)
    # a new session cannot tell whether the remote holds checkpoints: it does not start
    with pytest.raises(lowdiff.RemoteStorageError, match=r"cannot read the remote tier"):
        _ck(m, o, s, c, tmp_path / "fresh", backend, remote_timeout=4).resume()
    # a session that resumes from its local tier trains on while the remote is down
    plain = lowdiff.Checkpointer(
        tmp_path / "local",
        m,
        o,
        scheduler=s,
        extra_state={"data": c},
        full_every=F,
        records_per_file=B,
        compressor=lowdiff.TopK(ratio=0.01),
    )
    plain.resume()
    _train(plain, m, c, 0, 4)
    plain.close()
    ck = _ck(m, o, s, c, tmp_path / "local", backend, remote_timeout=4)
    assert ck.resume() == 4
    _train(ck, m, c, 4, 7)
    assert ck.flush() == 7  # the local tier does not wait for the remote
    t0 = time.monotonic()
    with pytest.raises(lowdiff.RemoteStorageError, match=r"127\.0\.0\.1:9|connect") as e:
        ck.flush(remote=True)
    assert time.monotonic() - t0 < 30
    assert "local tier step 7" in str(e.value) and ck.remote_durable_step == -1
    _train(ck, m, c, 7, 8)
    with pytest.raises(lowdiff.RemoteStorageError):
        ck.close()
    assert ck.durable_step == 8
    want = train_state(m, o, s, c)
    m2, o2, s2, c2 = _build(2)
    assert lowdiff.restore(tmp_path / "local", m2, o2, s2, extra_state={"data": c2}) == 8
    assert diff_states(want, train_state(m2, o2, s2, c2)) == []


def test_a_failing_upload_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWDIFF_FAULTS", "before_upload:full:1:eio,before_commit:records:2:eio")
    backend = Backend("file", f"file://{tmp_path}/remote")
    m, o, s, c = _build(0)
    ck = _ck(m, o, s, c, tmp_path / "local", backend)
    ck.resume()
    _train(ck, m, c, 0, 9)
    assert ck.flush(remote=True) == 9
    assert ck.stats["remote_errors"] == 2
    ck.close()
    leftovers = [p for p in (tmp_path / "remote" / "data").rglob("*") if p.is_file()]
    store = RemoteStore(backend.url)
    committed = {c.object for d in ("", "full", "records") for c in store.commits(d)[0].values()}
    # the data object of the commit that failed is not published (the next start removes it)
    assert (
        len(
            [p for p in leftovers if p.relative_to(tmp_path / "remote").as_posix() not in committed]
        )
        == 1
    )


def test_kill_between_upload_and_commit_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpointing process is killed after the data of the second full checkpoint
    is complete on the remote and before its commit: it is never read, the next session
    removes it and uploads that checkpoint again, and no local step is lost."""
    monkeypatch.setenv("LOWDIFF_FAULTS", "before_commit:full:2:kill-self")
    backend = Backend("file", f"file://{tmp_path}/remote")
    m, o, s, c = _build(0)
    ck = _ck(m, o, s, c, tmp_path / "local", backend, keep_full=None)
    ck.resume()
    proc = ck.strategy_impl.worker_process  # type: ignore[attr-defined]
    with pytest.raises(lowdiff.CheckpointWorkerError):
        _train(ck, m, c, 0, 6)
        proc.join(30)
        _train(ck, m, c, 6, 7)
    assert proc.exitcode == -9
    acked = ck.durable_step
    with pytest.raises(lowdiff.CheckpointWorkerError):
        ck.close()
    monkeypatch.delenv("LOWDIFF_FAULTS")
    # where the kill landed: full-4's data is on the remote, its commit is not
    data = sorted(p.name for p in (tmp_path / "remote" / "data" / "full").glob("*"))
    assert [n.split(".safetensors.")[0] for n in data] == ["full-000000000000", "full-000000000004"]
    store = RemoteStore(backend.url)
    assert sorted(store.commits("full")[0]) == ["full/full-000000000000.safetensors"]
    orphan = tmp_path / "remote" / "data" / "full" / data[1]

    m2, o2, s2, c2 = _build(2)
    ck2 = _ck(m2, o2, s2, c2, tmp_path / "local", backend, keep_full=None)
    got = ck2.resume()
    # full-4 was published locally before its upload began (the trainer may not have
    # been told of it yet: ck.durable_step can still say 3 when the kill lands)
    assert (tmp_path / "local" / "full" / "full-000000000004.safetensors").exists()
    assert got >= max(acked, 4), (got, acked)  # no acknowledged (or published) step lost
    assert ck2.flush(remote=True) == got
    assert not orphan.exists()
    # flush(remote=True) returns once the remote can recover `got`, which full-0 and the
    # record files committed before the kill may already do: close() drains the uploads
    ck2.close()
    assert "full/full-000000000004.safetensors" in store.commits("full")[0]


@pytest.mark.timeout(120)
def test_server_killed_mid_upload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 server is killed while a full checkpoint's upload is open (its first chunk
    written to the remote file, the object not complete): nothing of it is published,
    training and the local tier go on, and flush(remote=True) and close() say the remote
    is unreachable. (A bandwidth cap, set far above what is used, streams every file
    through an open remote file, the path large checkpoints take.)"""
    why = _s3_missing()
    if why:
        pytest.skip(why)
    server = MotoServer()
    server.start()
    try:
        mark = tmp_path / "in-upload"
        monkeypatch.setenv("LOWDIFF_FAULTS", "upload_chunk:full:2:slow")
        monkeypatch.setenv("LOWDIFF_FAULT_SLOW_S", "1.5")
        monkeypatch.setenv("LOWDIFF_FAULT_MARK", str(mark))
        backend = Backend("s3", f"s3://{new_bucket(server)}/run", server.options())
        m, o, s, c = _build(0)
        ck = _ck(m, o, s, c, tmp_path / "local", backend, remote_timeout=3, remote_bandwidth=1e12)
        ck.resume()
        _train(ck, m, c, 0, 5)
        deadline = time.monotonic() + 30
        while not mark.exists():  # the uploader is inside full-4's upload
            assert time.monotonic() < deadline, "the upload of full-4 never started"
            time.sleep(0.01)
        store = RemoteStore(backend.url, backend.options)
        assert "full/full-000000000004.safetensors" not in store.commits("full")[0]
        assert not store.fs.exists(store.key("full/full-000000000004.safetensors.commit"))
        server.stop()  # mid-upload
        _train(ck, m, c, 5, 8)
        assert ck.flush() == 8
        with pytest.raises(lowdiff.RemoteStorageError, match="full-000000000004"):
            ck.flush(remote=True)
        assert ck.remote_durable_step < 4
        with pytest.raises(lowdiff.RemoteStorageError):
            ck.close()
        want = train_state(m, o, s, c)
    finally:
        server.stop()
    m2, o2, s2, c2 = _build(2)
    assert lowdiff.restore(tmp_path / "local", m2, o2, s2, extra_state={"data": c2}) == 8
    assert diff_states(want, train_state(m2, o2, s2, c2)) == []


def _s3_missing() -> str:
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        return f"the S3 backend needs moto[server] and s3fs ({e})"
    return ""


def test_options_are_checked(tmp_path: Path) -> None:
    m, o, s, c = _build(0)
    with pytest.raises(ValueError, match="remote must be an fsspec URL"):
        lowdiff.Checkpointer(
            tmp_path, m, o, remote="/not/a/url", compressor=lowdiff.TopK(ratio=0.01)
        )
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        lowdiff.Checkpointer(
            tmp_path,
            m,
            o,
            remote=lowdiff.RemoteOptions("file:///x", storage_options=["a"]),
            compressor=lowdiff.TopK(ratio=0.01),
        )
    with pytest.raises(ValueError, match="bandwidth"):
        lowdiff.Checkpointer(
            tmp_path,
            m,
            o,
            remote=lowdiff.RemoteOptions("file:///x", bandwidth=0),
            compressor=lowdiff.TopK(ratio=0.01),
        )
    with pytest.raises(ValueError, match="remote= is supported by methods"):
        lowdiff.Checkpointer(
            None,
            m,
            o,
            method="compression-only",
            remote="file:///x",
            compressor=lowdiff.TopK(ratio=0.01),
        )
    ck = lowdiff.Checkpointer(tmp_path / "plain", m, o, compressor=lowdiff.TopK(ratio=0.01))
    assert ck.remote_durable_step == -1
    with pytest.raises(ValueError, match="no remote tier"):
        ck.flush(remote=True)
    ck.close()


def test_lowdiff_plus_uploads_its_persisted_checkpoints(backend: Backend, tmp_path: Path) -> None:
    """LowDiff+'s replica uploads each full checkpoint it persists; a new node recovers
    the newest one bit-identically."""
    m, o, s, c = _build(0)
    ck = lowdiff.Checkpointer(tmp_path / "local", m, o, method="lowdiff+", compressor=None, scheduler=s, extra_state={"data": c}, remote=lowdiff.RemoteOptions(backend.url, storage_options=backend.options, timeout=60), replica=lowdiff.ReplicaOptions(persist_every=3))  # fmt: skip
    assert ck.resume() == 0
    _train(ck, m, c, 0, 7)
    assert ck.flush(remote=True) == ck.durable_step == 7
    ck.close()
    assert ck.remote_durable_step == 7
    want = train_state(m, o, s, c)
    shutil.rmtree(tmp_path / "local")
    m2, o2, s2, c2 = _build(2)
    ck2 = lowdiff.Checkpointer(tmp_path / "local", m2, o2, method="lowdiff+", compressor=None, scheduler=s2, extra_state={"data": c2}, remote=lowdiff.RemoteOptions(backend.url, storage_options=backend.options))  # fmt: skip
    assert ck2.resume() == 7
    assert diff_states(want, train_state(m2, o2, s2, c2)) == []
    ck2.close()
