"""The remote tier: a checkpoint directory's copy on object storage or any fsspec URL.

:mod:`~lowdiff.remote.store` holds the commit protocol (data objects published by small
commit objects), :mod:`~lowdiff.remote.uploader` the checkpointing process's upload
thread, and :mod:`~lowdiff.remote.fetch` the download of a committed chain for recovery.
"""

from lowdiff.remote.fetch import Fetched, fetch, has_commits
from lowdiff.remote.store import Commit, RemoteStore, is_url
from lowdiff.remote.uploader import Uploader, reach

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
