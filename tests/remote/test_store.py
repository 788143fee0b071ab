"""The remote tier's commit protocol, on ``file://`` and on an S3 server (moto)."""

from __future__ import annotations

from pathlib import Path

import pytest

import lowdiff.errors as lowdiff_errors
from lowdiff.errors import CorruptCheckpointError, NotACheckpointDirectoryError, RecoveryWarning
from lowdiff.remote import RemoteStore, fetch, reach
from lowdiff.remote.commit import COMMIT_SUFFIX, DATA_DIR
from lowdiff.remote.uploader import Uploader

from .conftest import Backend, MotoServer, new_bucket


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / "src" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def test_put_publishes_only_a_complete_object(backend: Backend, tmp_path: Path) -> None:
    store = RemoteStore(backend.url, backend.options)
    data = bytes(range(256)) * 1000
    c = store.put(_file(tmp_path, "a.bin", data), "records/a.bin")
    assert (c.size, c.name) == (len(data), "records/a.bin")
    assert c.object.startswith(f"{DATA_DIR}/records/a.bin.")
    assert store.read_commit("records/a.bin") == c
    store.get(c, tmp_path / "out" / "a.bin")
    assert (tmp_path / "out" / "a.bin").read_bytes() == data

    # a new version replaces the commit, then its old data object goes
    c2 = store.put(_file(tmp_path, "a.bin", data[::-1]), "records/a.bin")
    assert c2.object != c.object and store.read_commit("records/a.bin") == c2
    assert not store.fs.exists(store.key(c.object))


def test_truncated_or_replaced_data_is_named_never_loaded(backend: Backend, tmp_path: Path) -> None:
    store = RemoteStore(backend.url, backend.options)
    data = b"x" * 5000
    c = store.put(_file(tmp_path, "a.bin", data), "records/a.bin")
    store.fs.pipe_file(store.key(c.object), data[:4000])  # a partial object
    dest = tmp_path / "out" / "a.bin"
    with pytest.raises(CorruptCheckpointError, match=r"truncated or replaced") as e:
        store.get(c, dest)
    assert c.object in str(e.value) and backend.url in str(e.value)
    assert not dest.exists()
    store.fs.pipe_file(store.key(c.object), b"y" * 5000)  # same size, other bytes
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        store.get(c, dest)
    assert not dest.exists()


def test_damaged_or_foreign_commit_objects_are_named(backend: Backend, tmp_path: Path) -> None:
    store = RemoteStore(backend.url, backend.options)
    store.put(_file(tmp_path, "a.bin", b"a" * 100), "full/a.bin")
    store.put(_file(tmp_path, "b.bin", b"b" * 100), "full/b.bin")
    key = store.key("full/a.bin" + COMMIT_SUFFIX)
    raw = store.fs.cat_file(key)
    store.fs.pipe_file(key, raw[:-10])  # torn
    store.fs.pipe_file(store.key("full/c.bin" + COMMIT_SUFFIX), raw.replace(b"a.bin", b"c.bin"))
    found, bad = store.commits("full")
    assert set(found) == {"full/b.bin"}
    assert (
        len(bad) == 2
        and any("a.bin.commit" in b for b in bad)
        and any("c.bin.commit" in b for b in bad)
    )


def test_clean_removes_uncommitted_data_and_keeps_committed(
    backend: Backend, tmp_path: Path
) -> None:
    store = RemoteStore(backend.url, backend.options)
    c = store.put(_file(tmp_path, "a.bin", b"a" * 100), "records/a.bin")
    orphan = f"{DATA_DIR}/records/b.bin.0123456789abcdef"  # a crash before its commit
    store.fs.pipe_file(store.key(orphan), b"partial")
    removed = store.clean()
    assert orphan in removed
    assert not store.fs.exists(store.key(orphan))
    assert store.fs.exists(store.key(c.object)) and store.read_commit("records/a.bin") == c


def test_clean_aborts_multipart_uploads_under_its_prefix_only(moto_server: MotoServer) -> None:
    bucket = new_bucket(moto_server)
    store = RemoteStore(f"s3://{bucket}/run", moto_server.options())
    mine = store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run/data/full/x.1")
    other = store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key="other/y")
    removed = store.clean()
    assert removed == ["multipart:run/data/full/x.1"]
    left = {u["UploadId"] for u in store.fs.list_multipart_uploads(bucket)}
    assert other["UploadId"] in left and mine["UploadId"] not in left


def test_bandwidth_cap_paces_the_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a cap the file is streamed in chunks, and the uploader sleeps so that the
    bytes sent never run ahead of the cap (the sleeps asked for are recorded here)."""
    import lowdiff.remote.store as store_mod

    monkeypatch.setattr(store_mod, "CHUNK_BYTES", 1000)
    slept: list[float] = []
    monkeypatch.setattr(store_mod.time, "sleep", slept.append)
    store = RemoteStore(f"file://{tmp_path}/remote", bandwidth=1000.0)
    chunks: list[str] = []
    c = store.put(_file(tmp_path, "a.bin", b"z" * 5000), "records/a.bin", hook=chunks.append)
    assert chunks == ["chunk"] * 5 + ["commit"] and c.size == 5000
    assert len(slept) == 5 and sum(slept) > 4.0  # about 5 s of pacing for 5000 B at 1000 B/s


def test_a_short_object_is_not_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The remote reports fewer bytes than were sent (a partial object): no commit."""
    store = RemoteStore(f"file://{tmp_path}/remote")
    real_info = store.fs.info
    monkeypatch.setattr(store.fs, "info", lambda p: {**real_info(p), "size": 10})
    with pytest.raises(lowdiff_errors.RemoteStorageError, match="not committed"):
        store.put(_file(tmp_path, "a.bin", b"q" * 100), "records/a.bin")
    assert store.commits("records")[0] == {}


def test_reach_needs_a_full_checkpoint_and_no_gap() -> None:
    assert reach(set(), {(0, 5)}) == -1
    assert reach({0}, set()) == 0
    assert reach({0}, {(0, 2), (3, 5), (7, 8)}) == 6
    assert reach({0, 7}, {(0, 2), (3, 5), (7, 8)}) == 9


def test_fetch_of_an_empty_remote_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NotACheckpointDirectoryError, match="no committed lowdiff manifest"):
        fetch(f"file://{tmp_path}/nothing", tmp_path / "out")


def test_uploader_protects_pending_files_and_retention_keeps_live_chain(tmp_path: Path) -> None:
    """The remote tier's retention keeps the newest keep_full full checkpoints and the
    record files reaching them; files not uploaded yet are protected locally."""
    from lowdiff.format import layout

    root = tmp_path / "local"
    (root / "full").mkdir(parents=True)
    (root / "records").mkdir()
    layout.write_manifest(root, {"format": "lowdiff"})
    names = []
    for s in (0, 4, 8):
        names.append(_file(root, f"full/full-{s:012d}.safetensors", b"F" * 64))
    for a, b in ((0, 3), (4, 7), (8, 9)):
        names.append(_file(root, f"records/rec-{a:012d}-{b:012d}.safetensors", b"R" * 32))
    for p in list(names):
        p.rename(root / p.relative_to(root / "src"))
    url = f"file://{tmp_path}/remote"
    got: list[int] = []
    up = Uploader(root, url, None, keep_full=2, on_durable=got.append)
    assert up.protected()  # before its catch-up has listed the files: all are kept
    up.start()
    assert up.drain(10)
    up.stop()
    store = RemoteStore(url)
    fulls, _ = store.commits("full")
    records, _ = store.commits("records")
    assert sorted(fulls) == [
        "full/full-000000000004.safetensors",
        "full/full-000000000008.safetensors",
    ]
    assert sorted(records) == [
        "records/rec-000000000004-000000000007.safetensors",
        "records/rec-000000000008-000000000009.safetensors",
    ]
    assert got[-1] == 10 and up.protected() == set()
    # these "full checkpoints" are not lowdiff files: named, left out, never loaded
    with pytest.warns(RecoveryWarning, match="full-000000000008.safetensors"):
        out = fetch(url, tmp_path / "new")
    assert len(out.damaged) == 2 and out.files == ["lowdiff.json"]
    assert not list((tmp_path / "new" / "full").glob("*"))
