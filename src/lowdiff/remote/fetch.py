"""Recovery's side of the remote tier: download a committed chain into a local directory.

:func:`fetch` makes a local checkpoint directory out of what the remote tier has
committed: by default only what recovery of the newest step reads (the manifest, the
newest full checkpoint that downloads intact, and the record files from its step on),
or with ``everything`` every committed object (``lowdiff verify``, ``lowdiff inspect``).
Local recovery then runs on that directory unchanged, so a recovery from the remote
yields the same bits as one from the local tier. Every byte is checked against its
commit object (size and xxh3-64), and every full checkpoint against its own checksum; a
damaged object is named in a :class:`RecoveryWarning` and left out (an older full
checkpoint is taken instead), never loaded.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowdiff.errors import (
    CorruptCheckpointError,
    NotACheckpointDirectoryError,
    RecoveryWarning,
    RemoteStorageError,
)
from lowdiff.format import layout, sfile
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
        store = RemoteStore(url, options)
        store.read_commit(layout.MANIFEST)
    except FileNotFoundError:
        return False
    except CorruptCheckpointError:
        return True  # something is there; fetch() names what is wrong
    except RemoteStorageError:
        raise
    except Exception as e:  # noqa: BLE001 -- every client has its own connection errors
        raise RemoteStorageError(
            f"cannot read the remote tier {url} to learn whether it holds checkpoints: "
            f"{type(e).__name__}: {e}"
        ) from e
    return True


def fetch(
    url: str,
    dest: str | Path,
    options: dict[str, Any] | None = None,
    *,
    everything: bool = False,
) -> Fetched:
    """Download the remote tier at ``url`` into the local directory ``dest``.

    Args:
        url: the remote tier (any fsspec URL), as passed as ``remote=``.
        dest: a local directory (created if missing); files already there with the
            same name are replaced.
        options: fsspec options (``remote_options``).
        everything: every committed object instead of the newest chain only.

    Raises:
        NotACheckpointDirectoryError: the remote holds no committed manifest.
        CorruptCheckpointError: its manifest's commit or bytes are damaged.
    """
    dest = Path(dest)
    store = RemoteStore(url, options)
    out = Fetched()
    try:
        manifest = store.read_commit(layout.MANIFEST)
    except FileNotFoundError:
        raise NotACheckpointDirectoryError(
            f"{url}: no committed lowdiff manifest (not a remote tier, or nothing uploaded yet)"
        ) from None
    store.get(manifest, dest / layout.MANIFEST)
    out.files.append(layout.MANIFEST)
    out.nbytes += manifest.size
    fulls, bad = store.commits(layout.FULL_DIR)
    records, bad_r = store.commits(layout.RECORDS_DIR)
    out.damaged += bad + bad_r
    by_step = sorted(
        (
            (s, c)
            for n, c in fulls.items()
            if (s := layout.parse_full_name(n.split("/")[-1])) is not None
        ),
        key=lambda sc: sc[0],
        reverse=True,
    )
    start: int | None = None
    for s, c in by_step:
        if not _get(store, c, dest, out, full=True):
            continue
        start = s if start is None else start
        if not everything:
            break
    for n, c in sorted(records.items()):
        r = layout.parse_records_name(n.split("/")[-1])
        if r is None:
            continue
        if everything or (start is not None and r[1] >= start):
            _get(store, c, dest, out, full=False)
    for why in out.damaged:
        warnings.warn(f"remote tier: left out {why}", RecoveryWarning, stacklevel=2)
    return out


def _get(store: RemoteStore, c: Any, dest: Path, out: Fetched, *, full: bool) -> bool:
    """Download one committed object; a damaged one is noted in ``out.damaged``."""
    path = dest / c.name
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
    out.files.append(c.name)
    out.nbytes += c.size
    return True
