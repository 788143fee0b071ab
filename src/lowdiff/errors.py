"""The exception hierarchy of lowdiff.

Every refusal, misuse and failure that lowdiff detects raises a subclass of
:class:`LowDiffError`. Those that the standard library would report as ``ValueError``,
``TypeError`` or ``RuntimeError`` also subclass that built-in, so ``except ValueError``
keeps working: :class:`InvalidArgumentError` (a bad value), :class:`ArgumentTypeError`
(a value of the wrong type, or an option that does not exist) and :class:`UsageError`
(a call out of order: ``step()`` after ``close()``, a second ``attach``).
"""

from __future__ import annotations

import os
from pathlib import Path


class LowDiffError(Exception):
    """Base class of every error lowdiff raises on its own account."""


class InvalidArgumentError(LowDiffError, ValueError):
    """An argument or option has a value lowdiff cannot use (named in the message, with
    the value and what would do)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument or option has the wrong type, or an option does not exist (the
    message names the nearest one that does)."""


class UsageError(LowDiffError, RuntimeError):
    """A call out of order: ``step()`` or ``resume()`` after ``close()``, ``resume()``
    twice, ``ck.step()`` on a Checkpointer driven by :func:`lowdiff.attach`, a second
    ``attach`` to one optimizer."""


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


class UnsupportedSetupError(LowDiffError, ValueError):
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
