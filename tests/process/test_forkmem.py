"""The training state is left out of the process server's fork (lowdiff.proc.forkmem)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tests import launch

from lowdiff.proc import forkmem

SCRIPT = Path(__file__).with_name("forkmem_script.py")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")


def test_ranges_are_the_whole_pages_inside_each_storage() -> None:
    big = torch.zeros(1 << 20)  # 4 MiB
    ptr, n = big.untyped_storage().data_ptr(), big.untyped_storage().nbytes()
    (start, end), = forkmem.ranges([big])  # fmt: skip
    assert start % forkmem.PAGE == 0 and end % forkmem.PAGE == 0
    assert ptr <= start < ptr + forkmem.PAGE and ptr + n - forkmem.PAGE < end <= ptr + n


def test_a_storage_seen_twice_is_one_range_and_small_or_shared_ones_none() -> None:
    big = torch.zeros(1 << 20)
    view = big[10:]  # the same storage (tied weights, views)
    small = torch.zeros(16)
    shared = torch.zeros(1 << 20).share_memory_()  # the server may need shared memory
    assert forkmem.ranges([big, view, small, shared]) == forkmem.ranges([big])
    assert forkmem.ranges([small, shared, torch.zeros(4, device="meta")]) == []


def test_only_the_longest_ranges_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [torch.zeros(n * (1 << 14)) for n in (1, 4, 2, 3)]
    monkeypatch.setattr(forkmem, "MAX_RANGES", 2)
    kept = forkmem.ranges(tensors)
    assert len(kept) == 2 and kept == sorted(kept)
    assert sorted(end - start for start, end in kept) == sorted(
        end - start for start, end in forkmem.ranges(tensors[1::2])
    )


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_the_server_holds_no_copy_of_the_state_and_the_trainer_writes_it_without_faults(
    tmp_path: Path, strategy: str
) -> None:
    """A trainer builds a Checkpointer (which forks the process server) with the
    optimizer state in place; a tensor of no Checkpointer is the control, shared as any
    memory is: the server maps its pages, and the trainer's first write faults on each."""
    out = launch.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "ck"), strategy],
        capture_output=True, text=True, env=launch.env(), timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # the control: shared copy on write, as before
    assert r["server_rss_kb_bystander"] >= r["bystander_pages"] * r["page_kb"] * 9 // 10
    assert r["faults_bystander"] >= r["bystander_pages"] * 9 // 10
    # the parameter's, gradient's and optimizer state's pages are not in the server
    assert r["server_rss_kb_state"] == 0
    assert r["faults_state"] < r["state_pages"] // 20
    # a later fork sees the state; the server's processes checkpoint it exactly
    assert r["later_fork_sees_state"]
    assert r["restored_equal"]


def test_share_leaves_nothing_out_and_an_unknown_choice_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = torch.nn.Linear(512, 512)
    forkmem.keep_out(model)
    done = forkmem.leave_out()
    forkmem.give_back(done)
    assert done  # the default: the weight's pages
    monkeypatch.setenv(forkmem.ENV, "share")
    assert forkmem.leave_out() == []
    monkeypatch.setenv(forkmem.ENV, "bogus")
    with pytest.raises(ValueError, match="LOWDIFF_FORK_STATE='bogus'"):
        forkmem.leave_out()
