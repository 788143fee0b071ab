"""The exception hierarchy of lowdiff.

Every failure that lowdiff itself detects raises a subclass of :class:`LowDiffError`.
Bad arguments at the API edge raise the built-in ``ValueError`` or ``TypeError``
instead, naming the argument and the value.
"""

from __future__ import annotations

import os
from pathlib import Path


class LowDiffError(Exception):
    """Base class of every error lowdiff raises on its own account."""


class CorruptCheckpointError(LowDiffError):
    """A checkpoint file is torn, truncated, corrupt or foreign. It is never loaded."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        # as given: a remote object's URL keeps its "//" (a Path would fold it)
        super().__init__(f"{os.fspath(path)}: {reason}")


class NewerFormatError(CorruptCheckpointError):
    """A file or manifest written by a newer lowdiff (a newer format version): refused
    whole (upgrade lowdiff), never passed over or quarantined as damaged."""


class CheckpointMismatchError(LowDiffError):
    """The checkpoint does not fit the model, optimizer or compressor it is loaded into."""


class RecoveryError(LowDiffError):
    """The requested state cannot be recovered from what is on disk."""


class NotACheckpointDirectoryError(LowDiffError):
    """The directory holds something other than a lowdiff checkpoint."""


class UnsupportedSetupError(LowDiffError):
    """The training setup is one lowdiff does not support (a model sharded across ranks
    with FSDP or DTensor); the message says what is unsupported and what to use instead."""


class DirectoryLockedError(LowDiffError):
    """Another trainer holds the checkpoint directory."""


class CheckpointWorkerError(LowDiffError):
    """The background checkpointing process failed; carries its original traceback.

    ``storage`` is True when the failure came from the storage (an ``OSError`` such as
    ``ENOSPC`` or ``EIO`` while writing), not from a bug or a lost process.
    """

    def __init__(self, message: str, remote_traceback: str = "", storage: bool = False) -> None:
        self.remote_traceback = remote_traceback
        self.storage = storage
        text = (
            message
            if not remote_traceback
            else f"{message}\n\n--- checkpointing process traceback ---\n{remote_traceback}"
        )
        super().__init__(text)


class RemoteStorageError(LowDiffError):
    """The remote tier (``remote=``) cannot be reached or refused an upload, or an object
    on it is torn, truncated or foreign. The local tier is not affected."""


class RecoveryWarning(UserWarning):
    """Recovery passed over damaged files or fell back to an older point."""


class DurabilityWarning(UserWarning):
    """Checkpointing is suspended after a storage error; says how many steps are not durable."""
