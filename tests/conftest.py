from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from tests import launch

from lowdiff.ddp.context import DistContext
from lowdiff_lab import faults as _faults  # noqa: F401 -- its processes install LOWDIFF_FAULTS
from lowdiff_lab.prefork import PreforkServer
from lowdiff_lab.torture import ddp
from lowdiff_lab.torture.report import TortureReport

# Tests run on 2 shared cores; more threads only add contention and noise.
_THREADS = int(os.environ.get("LOWDIFF_TEST_THREADS", "1"))
torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True)
def _same_thread_count():
    """Every test starts with the same torch thread count (a different count may round a
    reduction differently, so a test that left it changed would break exact comparisons
    in the tests after it)."""
    torch.set_num_threads(_THREADS)
    yield


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group for the test (destroyed after it); its context."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield DistContext(0, 1, dist.group.WORLD, torch.device("cpu"))
    dist.destroy_process_group()


# The torture tests add their figures here; the summary is printed at the end of the run.
_TORTURE = TortureReport()


@pytest.fixture(scope="session")
def torture_report() -> TortureReport:
    return _TORTURE


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist, a worker hands its torture figures to the controller."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["lowdiff_torture"] = _TORTURE.to_json()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ARG001
    """The controller adds up its workers' torture figures."""
    got = getattr(node, "workeroutput", {}).get("lowdiff_torture")
    if got is not None:
        _TORTURE.merge(TortureReport.from_json(got))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    r = _TORTURE
    if r.kills or r.corruptions or r.storage_faults or r.fuzz_inputs:
        terminalreporter.section("lowdiff torture summary")
        terminalreporter.write_line(r.format_text())


@pytest.fixture(scope="session")
def prefork() -> PreforkServer:
    """The warm Python the tests' trainer processes are forked from (see ``tests/launch.py``)."""
    return launch.server()


@pytest.fixture(scope="session")
def torchrun(prefork: PreforkServer) -> Callable[..., subprocess.CompletedProcess[str]]:
    """:func:`lowdiff_lab.torture.ddp.torchrun` with its agent forked from :func:`prefork`
    (its ranks are forks of the agent: see :mod:`lowdiff_lab.torture.ddp_agent`)."""
    return functools.partial(ddp.torchrun, server=prefork)
