"""Background processes: spawning, the trainer-to-process link and its typed protocol."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable ``name``, one of ``choices`` (the first when it
    is unset or empty; case and surrounding spaces do not count).

    Raises:
        ValueError: If it holds anything else.
    """
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return value
