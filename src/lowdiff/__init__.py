"""lowdiff: per-iteration checkpointing for PyTorch training.

Example:
    >>> import lowdiff  # doctest: +SKIP
    >>> ck = lowdiff.Checkpointer("runs/ckpt", model, optimizer)  # doctest: +SKIP
    >>> start = ck.resume()  # doctest: +SKIP
"""

from __future__ import annotations

from lowdiff.attach import attach
from lowdiff.attach import own_strategy as own_strategy  # internal: for tests and tools
from lowdiff.checkpointer import Checkpointer
from lowdiff.compressors import QSGD, ApproxTopK, Compressor, NoCompression, RandomK, TopK
from lowdiff.errors import (
    ArgumentTypeError,
    CheckpointMismatchError,
    CheckpointWorkerError,
    CorruptCheckpointError,
    DirectoryLockedError,
    DurabilityWarning,
    InvalidArgumentError,
    LowDiffError,
    NewerFormatError,
    NotACheckpointDirectoryError,
    RecoveryError,
    RecoveryWarning,
    RemoteStorageError,
    UnsupportedSetupError,
    UsageError,
)
from lowdiff.exporting import export
from lowdiff.inspection import DirectoryInfo, JobInfo, inspect_dir, inspect_job, verify_dir
from lowdiff.methods import DirectoryKind, register_method
from lowdiff.options import RemoteOptions, ReplicaOptions, Timeouts
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.recovery.restore import restore
from lowdiff.strategy import StepTimings, Strategy

__version__ = "0.2.0"

__all__ = [
    "ApproxTopK",
    "ArgumentTypeError",
    "CheckpointMismatchError",
    "CheckpointWorkerError",
    "Checkpointer",
    "Compressor",
    "CorruptCheckpointError",
    "DirectoryInfo",
    "DirectoryKind",
    "DirectoryLockedError",
    "DurabilityWarning",
    "InvalidArgumentError",
    "JobInfo",
    "LowDiffError",
    "NewerFormatError",
    "NoCompression",
    "NotACheckpointDirectoryError",
    "QSGD",
    "RandomK",
    "RecoveryError",
    "RecoveryStats",
    "RecoveryWarning",
    "RemoteOptions",
    "RemoteStorageError",
    "ReplicaOptions",
    "StepTimings",
    "Strategy",
    "Timeouts",
    "TopK",
    "UnsupportedSetupError",
    "UsageError",
    "attach",
    "export",
    "inspect_dir",
    "inspect_job",
    "register_method",
    "restore",
    "verify_dir",
    "__version__",
]
