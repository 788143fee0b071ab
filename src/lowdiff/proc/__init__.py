"""Background processes: spawning, the trainer-to-process link and its typed protocol."""

from __future__ import annotations

import ctypes
import os
from typing import Any

from lowdiff.errors import InvalidArgumentError

_libc: Any = None


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable ``name``, one of ``choices`` (the first when it
    is unset or empty; case and surrounding spaces do not count).

    Raises:
        ValueError: If it holds anything else.
    """
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise InvalidArgumentError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return value


def libc() -> Any:
    """This process's C library, with ``madvise`` and ``mmap`` typed (Linux); raises
    ``OSError`` where it cannot be loaded."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.mmap.restype = ctypes.c_void_p
        _libc = lib
    return _libc
