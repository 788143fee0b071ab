"""A whole node of a 2-node torchrun job lost mid-run, with a shared checkpoint directory.

Nodes A and B (one elastic agent and one gloo rank each, c10d rendezvous on 127.0.0.1,
:mod:`tests.ddp.nodes`) train :mod:`lowdiff_lab.torture.ddp_job` into one directory. Once
rank 1 logged step 6, node B is lost: its agent, its trainer and its checkpointing
process are SIGKILLed. A's agent restarts its rank, node C joins as B's replacement
(rank 1), and the job resumes from disk: LowDiff+'s replica of B's shard went with the
node, so no rank recovers from memory (what ``docs/guides/failures.md`` says of a lost
node). The job resumes at a step no older than the last durable step the survivor was
told, and ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import lowdiff_lab.torture.ddp_job as ddp_job
from lowdiff.state.capture import diff_states

from .nodes import Job
from .test_ddp_lowdiff import _load

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS, LOSE_AT = 16, 6


def _args(d: Path, out: Path, method: str) -> list[str]:
    return [
        "--dir", str(d), "--out", str(out), "--strategy", method, "--steps", str(STEPS),
        "--full-every", "4", "--batch-size", "2", "--log-durable", str(out / "durable"),
    ]  # fmt: skip


def _lines(path: Path) -> list[list[str]]:
    return [ln.split() for ln in path.read_text().splitlines() if ln] if path.exists() else []


def _last_step(path: Path) -> int:
    steps = [int(f[0]) for f in _lines(path) if f[0].isdigit()]
    return steps[-1] if steps else 0


@pytest.mark.parametrize("method", ["lowdiff", "lowdiff+"])
def test_node_loss_resumes_from_the_shared_directory(torchrun, tmp_path, method):
    ref = tmp_path / "ref"
    ref.mkdir()
    torchrun(*_args(tmp_path / "ck-ref", ref, method))
    out = tmp_path / "out"
    out.mkdir()
    args = [*_args(tmp_path / "ck", out, method), "--step-sleep", "0.25"]
    with Job(Path(ddp_job.__file__), args, tmp_path, out=out, max_restarts=1) as job:
        a, b = job.start("A"), job.start("B")
        deadline = time.monotonic() + 90
        while _last_step(out / "durable-rank1.txt") < LOSE_AT:
            assert time.monotonic() < deadline and b.proc.poll() is None, b.tail()
            time.sleep(0.02)
        told = [int(f[1]) for f in _lines(out / "durable-rank0.txt") if f[0].isdigit()]
        b.lose()
        lost_at = _last_step(out / "durable-rank1.txt")
        c = job.start("C")
        assert a.wait(120) == 0, a.tail()
        assert c.wait(120) == 0, c.tail()
    assert LOSE_AT <= lost_at < STEPS  # the loss landed mid-run
    resumes = [f for f in _lines(out / "durable-rank0.txt") if f[0] == "resume"]
    assert [r[3] for r in resumes] == ["0", "1"]  # A's first attempt, then its restart
    _, step, source, _ = resumes[1]
    assert source == "disk"  # B's replica, or its writer, went with the node
    assert int(step) >= max(told)  # no step the survivor was told durable is lost
    for r in (0, 1):
        assert diff_states(_load(ref / f"final-rank{r}.pt"), _load(out / f"final-rank{r}.pt")) == []
