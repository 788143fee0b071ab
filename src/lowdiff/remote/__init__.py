"""The remote tier: a checkpoint directory's copy on object storage or any fsspec URL.

:mod:`~lowdiff.remote.store` holds the commit protocol (data objects published by small
commit objects, :mod:`~lowdiff.remote.commit`), :mod:`~lowdiff.remote.uploader` the
checkpointing process's upload thread (:mod:`~lowdiff.remote.ledger`: what it knows
committed, the durable step, the remote's retention), and :mod:`~lowdiff.remote.fetch`
the download of a committed chain for recovery.
"""

from lowdiff.remote.commit import Commit
from lowdiff.remote.fetch import Fetched, fetch, has_commits
from lowdiff.remote.ledger import reach
from lowdiff.remote.store import RemoteStore, is_url
from lowdiff.remote.uploader import Uploader

__all__ = [
    "Commit",
    "Fetched",
    "RemoteStore",
    "Uploader",
    "fetch",
    "has_commits",
    "is_url",
    "reach",
]
