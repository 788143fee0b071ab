"""strategy="gemini": in-memory checkpoints in a holder process, rare persistence.

- a closed session resumes exactly from disk; ``persist_every`` decides which steps reach it;
- a SIGKILLed trainer (a real process) is recovered from the holder's memory at the newest
  in-memory step, exactly, and the holder goes on serving the new trainer;
- when the holder dies too, recovery reads the newest persisted file, exactly;
- under DDP (2 ranks, gloo), a rank whose holder is lost gets its state from the copy its
  peer's holder keeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tests import launch
from tests.baselines import harness

import lowdiff
from lowdiff.format import layout
from lowdiff.proc import holder as rp
from lowdiff_lab.baselines.base import load_state, restore_state
from lowdiff_lab.baselines.gemini import GeminiCheckpointer

REPO = Path(__file__).resolve().parents[2]
OPTS: dict[str, Any] = {"full_every": 1, "persist_every": 3, "keep_full": None}


def _ckpt_steps(d: Path) -> list[int]:
    return sorted(int(p.name[5:17]) for p in (d / "full").glob("ckpt-*.pt"))


def _writer_free(d: Path, timeout: float = 30.0) -> None:
    from lowdiff_lab.baselines.gemini_link import writer_busy as _writer_busy

    deadline = time.monotonic() + timeout
    while _writer_busy(d):
        assert time.monotonic() < deadline, "the holder process did not exit"
        time.sleep(0.05)


def test_bad_options(tmp_path: Path) -> None:
    model, opt, _ = harness.build()
    for bad, err in (
        ({"persist_every": 0}, ValueError),
        ({"persist_every": 2.5}, TypeError),
        ({"idle_timeout": -1}, ValueError),
        ({"idle_timeout": "long"}, TypeError),
        ({"idle_timeout": float("nan")}, ValueError),
        ({"max_lag": 2}, TypeError),
    ):
        name = next(iter(bad))
        with pytest.raises(err, match=name):
            lowdiff.Checkpointer(model, opt, tmp_path / "a", strategy="gemini", **bad)
    with pytest.raises(ValueError, match="directory"):
        lowdiff.Checkpointer(None, model, opt, method="gemini")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def _abandon(ck: Any) -> None:
    """What a trainer's death does to its holder, without ending this process: the
    connection closes and the directory lock is released."""
    ck = ck.strategy_impl
    ck._join_copy()
    ck._conn.close()
    ck._conn = None
    ck._shutdown()  # with no connection left: stops the copy thread only
    ck._closed = True
    ck._release()


# --------------------------------------------------------------------------- real processes


_TRAINER = """
import json, sys, time
import torch
sys.path.insert(0, {repo!r})
from tests.baselines import harness
import lowdiff

cfg = json.loads(sys.argv[1])
torch.set_num_threads(1)
model, opt, sched = harness.build()
ck = lowdiff.Checkpointer(model, opt, cfg["dir"], strategy="gemini", scheduler=sched,
                          idle_timeout=60, **cfg["opts"])
ck.resume()
for t in range(cfg["steps"]):
    harness.train_step(model, t)
    ck.step()
    opt.zero_grad()
# the holder has taken the newest checkpoint, and the disk has what persist_every asks for
while ck.stats["memory_step"] < cfg["steps"] or ck.durable_step < cfg["durable"]:
    time.sleep(0.01)
print("ready", ck.strategy_impl.holder_pid, flush=True)
time.sleep(600)
"""


class _Trainer:
    """A training process running a small script, started at once so that several start
    in parallel; it trains, reports its holder's pid and waits to be killed."""

    def __init__(self, d: Path, steps: int, durable: int) -> None:
        cfg = {"dir": str(d), "steps": steps, "durable": durable, "opts": OPTS}
        self.d = d
        self.proc = launch.popen(
            [sys.executable, "-c", _TRAINER.format(repo=str(REPO)), json.dumps(cfg)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def ready(self) -> int:
        """Wait until it has trained; returns its holder's pid."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.proc.kill()
            raise AssertionError(f"the training process failed (exit {self.proc.wait()})")
        return int(line.split()[1])

    def sigkill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        desc = rp.read_descriptor(self.d)
        if desc is not None and rp.pid_alive(desc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(desc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Trainer]]:
    root = tmp_path_factory.mktemp("gemini-trainers")
    runs = {
        "memory": _Trainer(root / "memory", 7, durable=6),
        "disk": _Trainer(root / "disk", 8, durable=6),
    }
    yield runs
    for t in runs.values():
        t.cleanup()


@pytest.mark.multiprocess
def test_killed_trainer_recovers_from_memory(trainers: dict[str, _Trainer]) -> None:
    run = trainers["memory"]
    d = run.d
    holder = run.ready()
    run.sigkill()
    assert rp.pid_alive(holder)
    ck, objects, resumed = harness.run(d, 0, 7, strategy="gemini", close=False, **OPTS)
    stats = ck.recovery_stats
    assert isinstance(ck.strategy_impl, GeminiCheckpointer)
    assert resumed == 7 and stats is not None  # the newest in-memory step; disk has 6
    assert stats.source == "memory" and stats.files_read == 0
    harness.assert_exact(harness.reference(7), objects)
    # the holder of the killed trainer serves the new one
    assert ck.strategy_impl.holder_pid == holder and ck.durable_step == 6
    model, opt, _ = objects
    for t in range(7, 10):
        harness.train_step(model, t)
        ck.step()
        opt.zero_grad()
    assert ck.stats["memory_step"] in (9, 10)
    ck.close()
    harness.assert_exact(harness.reference(10), objects)
    # persist_every=3: steps 0, 3, 6, 9 on disk, and the newest at close
    assert _ckpt_steps(d) == [0, 3, 6, 9, 10]
    _writer_free(d)
    assert rp.read_descriptor(d) is None
    # a closed session leaves no holder: the next one resumes exactly from disk
    ck, objects, resumed = harness.run(d, 0, 10, strategy="gemini", **OPTS)
    assert resumed == 10 and ck.recovery_stats is not None
    assert ck.recovery_stats.source == "disk" and ck.recovery_stats.bytes_read > 0
    harness.assert_exact(harness.reference(10), objects)


@pytest.mark.multiprocess
def test_killed_trainer_and_holder_recover_from_disk(trainers: dict[str, _Trainer]) -> None:
    run = trainers["disk"]
    d = run.d
    holder = run.ready()
    desc = rp.read_descriptor(d)
    assert desc is not None and desc.pid == holder
    os.kill(holder, signal.SIGKILL)
    run.sigkill()
    _writer_free(d)
    ck, objects, resumed = harness.run(
        d, 0, 6, strategy="gemini", close=False, **dict(OPTS, idle_timeout=0.5)
    )
    assert resumed == 6 and ck.recovery_stats is not None  # in memory were 7 and 8
    assert ck.recovery_stats.source == "disk"
    harness.assert_exact(harness.reference(6), objects)
    # the dead holder's shared memory was found stale and removed, never attached
    assert ck.strategy_impl.holder_pid != holder
    assert not any(n.startswith(f"lowdiff-{desc.run_id[:16]}") for n in os.listdir("/dev/shm"))
    assert ck.durable_step == 6 and ck.stats["memory_step"] == 6
    model, opt, _ = objects
    for t in range(6, 8):
        harness.train_step(model, t)
        ck.step()
        opt.zero_grad()
    # 7 and 8 are in memory only; the trainer dies and no new one comes: after idle_timeout
    # the holder persists its newest checkpoint and exits
    _abandon(ck)
    _writer_free(d)
    assert _ckpt_steps(d) == [0, 3, 6, 8]
    assert rp.read_descriptor(d) is None
    model, opt, sched = harness.build(seed=1)
    restore_state(load_state(d / "full" / "ckpt-000000000008.pt"), model, opt, sched, where="8")
    harness.assert_exact(harness.reference(8), (model, opt, sched))


# --------------------------------------------------------------------------- DDP


def _ddp_build(seed: int) -> tuple[Any, Any, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model, opt, sched = harness.build(seed)
    return DistributedDataParallel(model), opt, sched


def _ddp_train(objects: tuple[Any, Any, Any], ck: Any, rank: int, start: int, stop: int) -> None:
    model, opt, sched = objects
    for t in range(start, stop):
        x, y = harness.batch(2 * t + rank)  # every rank its own data
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if ck is None:
            opt.step()
            sched.step()
        else:
            ck.step()
        opt.zero_grad()


def _ddp_rank(rank: int, d: str, init: str, out: str) -> None:
    """One rank: train 5 steps, lose the trainer (and, on rank 1, the holder), resume."""
    import torch.distributed as dist

    from lowdiff.ddp.context import rank_dir
    from lowdiff.state.capture import diff_states, snapshot_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    opts = {"full_every": 1, "persist_every": 100, "idle_timeout": 60}
    old = _ddp_build(0)
    ck = lowdiff.Checkpointer(old[0], old[1], d, strategy="gemini", scheduler=old[2], **opts)
    assert ck.resume() == 0
    _ddp_train(old, ck, rank, 0, 5)
    want = snapshot_state(*old)
    _abandon(ck)  # the trainer is lost
    dist.barrier()
    if rank == 1:  # and rank 1's host with it: its holder is gone too
        desc = rp.read_descriptor(rank_dir(Path(d), 1))
        assert desc is not None
        os.kill(desc.pid, signal.SIGKILL)
        _writer_free(rank_dir(Path(d), 1))
    dist.barrier()
    new = _ddp_build(1)
    ck = lowdiff.Checkpointer(new[0], new[1], d, strategy="gemini", scheduler=new[2], **opts)
    step = ck.resume()
    assert ck.recovery_stats is not None
    result = {
        "step": step,
        "source": ck.recovery_stats.source,
        "diffs": diff_states(want, snapshot_state(*new)),
    }
    # training goes on exactly as it would have without the failure
    rng = torch.get_rng_state()
    _ddp_train(new, ck, rank, 5, 7)
    ck.close()
    torch.set_rng_state(rng)
    _ddp_train(old, None, rank, 5, 7)
    result["diffs_after"] = diff_states(snapshot_state(*old), snapshot_state(*new))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_ddp_lost_host_recovers_from_its_peer(tmp_path: Path) -> None:
    import torch.multiprocessing as tmp

    d = tmp_path / "ckpt"
    # forked ranks start without importing torch again (safe only while this process runs
    # no other thread); their holders are spawned as in any job
    tmp.start_processes(
        _ddp_rank,
        args=(str(d), f"file://{tmp_path / 'pg'}", str(tmp_path)),
        nprocs=2,
        start_method="fork" if threading.active_count() == 1 else "spawn",
    )
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # rank 0 from its holder's memory; rank 1 from the copy rank 0's holder keeps
    assert [(g["step"], g["source"]) for g in got] == [(5, "memory"), (5, "peer")]
    assert [g["diffs"] for g in got] == [[], []]
    assert [g["diffs_after"] for g in got] == [[], []]
    for r in (0, 1):
        assert (d / f"rank-{r:05d}" / layout.MANIFEST).exists()
        _writer_free(d / f"rank-{r:05d}")
