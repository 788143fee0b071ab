"""The remote tier's backends: ``file://`` and an S3 server (moto) on 127.0.0.1.

The S3 server is moto's server mode in a subprocess started by the tests themselves, as
s3fs tests itself; nothing leaves the machine. Without moto (or s3fs) installed the S3
cases are skipped, and say why.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

with contextlib.suppress(ImportError):
    # imported before any test starts lowdiff's process server (forked from this process
    # at the first Checkpointer), as lowdiff.remote.store.preload arranges for a trainer
    # whose first Checkpointer has remote=: its checkpointing processes find s3fs loaded
    import s3fs  # noqa: F401

CREDENTIALS = {"key": "testing", "secret": "testing"}


@dataclass
class Backend:
    """A remote tier for one test: its URL and fsspec options."""

    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)


class MotoServer:
    """moto's S3 server in a subprocess on 127.0.0.1 (a free port)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.endpoint = ""

    def start(self) -> None:
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("moto server exited before it listened")
            if "Running on http://" in line:
                self.endpoint = line.split("Running on ", 1)[1].strip()
                # keep reading its log: a full pipe would block the server's logging,
                # and with it every request (moto logs each one)
                threading.Thread(target=_discard, args=(self.proc.stdout,), daemon=True).start()
                return
        raise RuntimeError("moto server did not start within 60 s")

    def options(self) -> dict[str, Any]:
        return {
            **CREDENTIALS,
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            # a server that is gone fails fast, not after minutes of retries
            "config_kwargs": {
                "connect_timeout": 1,
                "read_timeout": 5,
                "retries": {"max_attempts": 1},
            },
        }

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _discard(stream: Any) -> None:
    for _line in stream:
        pass


def _have_s3() -> str:
    """'' when the S3 backend can run, else why not."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        return f"the S3 backend needs moto[server] and s3fs ({e})"
    return ""


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    why = _have_s3()
    if why:
        pytest.skip(why)
    server = MotoServer()
    server.start()
    yield server
    server.stop()


def new_bucket(server: MotoServer) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.options())
    name = f"b{uuid.uuid4().hex[:12]}"
    fs.call_s3("create_bucket", Bucket=name)
    return name


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    """Each remote-tier test runs against ``file://`` and against the S3 server."""
    if request.param == "file":
        return Backend("file", f"file://{tmp_path}/remote")
    server = request.getfixturevalue("moto_server")
    return Backend("s3", f"s3://{new_bucket(server)}/run", server.options())
