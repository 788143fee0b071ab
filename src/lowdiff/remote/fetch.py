"""Recovery's side of the remote tier: download a committed chain into a local directory.

:func:`fetch` makes a local checkpoint directory out of what the remote tier has
committed: by default only what recovery of the newest step reads (the manifest, the
newest full checkpoint that downloads intact, and the record files from its step on),
or with ``everything`` every committed object (``lowdiff verify``, ``lowdiff inspect``).
A distributed job's remote tier is a tree of such tiers, one per folder of the job
directory, and comes down as that tree.
Local recovery then runs on that directory unchanged, so a recovery from the remote
yields the same bits as one from the local tier. Every byte is checked against its
commit object (size and xxh3-64), and every full checkpoint against its own checksum; a
damaged object is named in a :class:`RecoveryWarning` and left out (an older full
checkpoint is taken instead), never loaded.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowdiff.errors import (
    CorruptCheckpointError,
    LowDiffError,
    NotACheckpointDirectoryError,
    RecoveryWarning,
    RemoteStorageError,
)
from lowdiff.format import layout, sfile
from lowdiff.remote.commit import DATA_DIR, Commit
from lowdiff.remote.store import RemoteStore


@dataclass
class Fetched:
    """What :func:`fetch` downloaded (names relative to the directory), what it left out
    as damaged (with why), and the bytes it read."""

    files: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    nbytes: int = 0


def has_commits(url: str, options: dict[str, Any] | None = None) -> bool:
    """Whether the remote tier at ``url`` holds a committed manifest.

    Raises:
        RemoteStorageError: the remote cannot be read (unreachable, refused): whether it
            holds checkpoints is unknown, and a new session must not write over them.
    """
    try:
        with reading(url, "to learn whether it holds checkpoints"):
            RemoteStore(url, options).read_commit(layout.MANIFEST)
    except FileNotFoundError:
        return False
    except CorruptCheckpointError:
        return True  # something is there; fetch() names what is wrong
    return True


@contextlib.contextmanager
def reading(url: str, purpose: str = "") -> Iterator[None]:
    """Reads of the remote tier at ``url``: what the file system's client raises beyond
    lowdiff's own errors and ``FileNotFoundError`` (no credentials, an unreachable
    endpoint, a protocol whose fsspec package is not installed) becomes a
    :class:`RemoteStorageError` that names the URL."""
    try:
        yield
    except (LowDiffError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 -- every client has its own connection errors
        why = f" {purpose}" if purpose else ""
        raise RemoteStorageError(
            f"cannot read the remote tier {url}{why}: {type(e).__name__}: {e}"
        ) from e


def fetch(
    url: str,
    dest: str | Path,
    options: dict[str, Any] | None = None,
    *,
    everything: bool = False,
    mine: Callable[[str], bool] | None = None,
    agree_min: Callable[[int], int] | None = None,
) -> Fetched:
    """Download the remote tier at ``url`` into the local directory ``dest``.

    A distributed job's remote tier (one tier per folder of the job directory: its
    shards ``rank-NNNNN``, generations ``gen-G`` and their shards) is downloaded as the
    same tree. The shards of one folder are recovered from a full checkpoint of a step
    they all hold, so for each such group the newest step whose full checkpoint every
    shard has committed, and that downloads intact in every shard, is taken, with each
    shard's record files from there on.

    Args:
        url: the remote tier (any fsspec URL), as passed as ``remote=``.
        dest: a local directory (created if missing); files already there with the
            same name are replaced.
        options: fsspec options (``remote_options``).
        everything: every committed object instead of the newest chain only.
        mine: which folders (``""``: the top one, ``"gen-1/rank-00001"``, ...) this
            caller downloads (None: all). The ranks of a job split the download this way.
        agree_min: the minimum of a value over every caller that downloads a share
            (under DDP an all-reduce; None: one caller); every caller makes the same calls.

    Raises:
        NotACheckpointDirectoryError: the remote holds no committed manifest.
        CorruptCheckpointError: its manifest's commit or bytes are damaged.
        RemoteStorageError: the remote cannot be read (no credentials, unreachable, the
            protocol's fsspec package missing).

    Example:
        >>> fetch("s3://bucket/run", "/tmp/run")  # doctest: +SKIP
    """
    with reading(url):
        return _fetch(url, Path(dest), options, everything, mine, agree_min)


def _fetch(
    url: str,
    dest: Path,
    options: dict[str, Any] | None,
    everything: bool,
    mine: Callable[[str], bool] | None,
    agree_min: Callable[[int], int] | None,
) -> Fetched:
    store = RemoteStore(url, options)
    try:
        store.read_commit(layout.MANIFEST)
    except FileNotFoundError:
        raise NotACheckpointDirectoryError(
            f"{url}: no committed lowdiff manifest (not a remote tier, or nothing uploaded yet)"
        ) from None
    take = mine or (lambda _rel: True)
    agree = agree_min or (lambda v: v)
    out = Fetched()
    tiers = [_Tier.list(store, rel) for rel in tiers_of(store)]
    for t in tiers:
        if take(t.rel):
            name = f"{t.rel}/{layout.MANIFEST}" if t.rel else layout.MANIFEST
            t.store.get(t.manifest, dest / name)  # a damaged manifest is an error
            out.files.append(name)
            out.nbytes += t.manifest.size
            out.damaged += t.bad
    for group in _groups(tiers):
        if everything:
            for t in group:
                if take(t.rel):
                    _everything(t, dest, out)
        else:
            _newest_chain(group, dest, out, take, agree)
    for why in out.damaged:
        warnings.warn(f"remote tier: left out {why}", RecoveryWarning, stacklevel=3)
    return out


def tiers_of(store: RemoteStore) -> list[str]:
    """The folders under ``store`` (``""``: itself) that hold a committed manifest:
    itself, a job's shards, its generations and theirs (two levels down at most)."""
    found = [""]
    frontier = [""]
    for _depth in range(2):
        below = []
        for rel in frontier:
            for name in store.folders(rel):
                if name in (DATA_DIR, layout.FULL_DIR, layout.RECORDS_DIR):
                    continue
                sub = f"{rel}/{name}" if rel else name
                below.append(sub)
                with contextlib.suppress(FileNotFoundError):
                    store.sub(sub).read_commit(layout.MANIFEST)
                    found.append(sub)
        frontier = below
    return found


@dataclass
class _Tier:
    """One folder's committed objects: manifest, full checkpoints by step, record files."""

    rel: str
    store: RemoteStore
    manifest: Commit
    fulls: dict[int, Commit]
    records: dict[tuple[int, int], Commit]
    bad: list[str]

    @staticmethod
    def list(root: RemoteStore, rel: str) -> _Tier:
        store = root.sub(rel)
        fulls, bad = store.fulls()
        records, bad_r = store.records()
        return _Tier(rel, store, store.read_commit(layout.MANIFEST), fulls, records, bad + bad_r)


def _groups(tiers: list[_Tier]) -> list[list[_Tier]]:
    """The tiers that hold checkpoints, grouped by parent folder (a job generation's
    shards; the top folder of a single process's directory is a group of its own)."""
    by_parent: dict[str | None, list[_Tier]] = {}
    for t in tiers:
        if t.fulls or t.records:
            parent = None if not t.rel else t.rel.rpartition("/")[0]
            by_parent.setdefault(parent, []).append(t)
    return list(by_parent.values())


def _newest_chain(
    group: list[_Tier],
    dest: Path,
    out: Fetched,
    take: Callable[[str], bool],
    agree: Callable[[int], int],
) -> None:
    """The newest full checkpoint every tier of ``group`` holds and downloads intact
    (older ones in turn), and each tier's record files from its step on."""
    common = set.intersection(*(set(t.fulls) for t in group))
    below: int | None = None
    while True:
        step = agree(max((s for s in common if below is None or s < below), default=-1))
        if step < 0:
            return
        ok = step in common and all(
            _get(t, t.fulls[step], dest, out, full=True) for t in group if take(t.rel)
        )
        if agree(int(ok)) == 1:
            break
        below = step
    for t in group:
        if take(t.rel):
            for r, c in sorted(t.records.items()):
                if r[1] >= step:
                    _get(t, c, dest, out, full=False)


def _everything(t: _Tier, dest: Path, out: Fetched) -> None:
    for c in t.fulls.values():
        _get(t, c, dest, out, full=True)
    for c in t.records.values():
        _get(t, c, dest, out, full=False)


def _get(t: _Tier, c: Commit, dest: Path, out: Fetched, *, full: bool) -> bool:
    """Download one committed object of tier ``t``; a damaged one is noted in
    ``out.damaged``."""
    name = f"{t.rel}/{c.name}" if t.rel else c.name
    path = dest / name
    store = t.store
    try:
        store.get(c, path)
        if full:
            try:
                sfile.verify(path)  # damaged before upload: caught here, an older one is used
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(store.where(c.object), e.reason) from None
    except CorruptCheckpointError as e:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        out.damaged.append(str(e))
        return False
    out.files.append(name)
    out.nbytes += c.size
    return True
