"""lowdiff: per-iteration checkpointing for PyTorch by reusing compressed gradients.

Example:
    >>> import lowdiff  # doctest: +SKIP
    >>> ck = lowdiff.Checkpointer(model, optimizer, "runs/ckpt", compressor=lowdiff.TopK(ratio=0.01))  # doctest: +SKIP
    >>> start = ck.resume()  # doctest: +SKIP
"""

from __future__ import annotations

from lowdiff.attach import attach, own_strategy
from lowdiff.checkpointer import Checkpointer
from lowdiff.compressors import QSGD, ApproxTopK, Compressor, NoCompression, RandomK, TopK
from lowdiff.errors import (
    CheckpointMismatchError,
    CheckpointWorkerError,
    CorruptCheckpointError,
    DirectoryLockedError,
    DurabilityWarning,
    LowDiffError,
    NewerFormatError,
    NotACheckpointDirectoryError,
    RecoveryError,
    RecoveryWarning,
    RemoteStorageError,
    UnsupportedSetupError,
)
from lowdiff.exporting import export
from lowdiff.inspect import DirectoryInfo, JobInfo, inspect_dir, inspect_job, verify_dir
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.recovery.restore import restore

__version__ = "0.1.0"

__all__ = [
    "ApproxTopK",
    "CheckpointMismatchError",
    "CheckpointWorkerError",
    "Checkpointer",
    "Compressor",
    "CorruptCheckpointError",
    "NewerFormatError",
    "DirectoryInfo",
    "JobInfo",
    "DirectoryLockedError",
    "DurabilityWarning",
    "LowDiffError",
    "NoCompression",
    "NotACheckpointDirectoryError",
    "QSGD",
    "RandomK",
    "RecoveryError",
    "RecoveryStats",
    "RecoveryWarning",
    "RemoteStorageError",
    "TopK",
    "UnsupportedSetupError",
    "attach",
    "own_strategy",
    "export",
    "inspect_dir",
    "inspect_job",
    "restore",
    "verify_dir",
    "__version__",
]
