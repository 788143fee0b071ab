"""A whole node of a 2-node torchrun job lost mid-run, with a shared checkpoint directory
(:mod:`lowdiff_lab.torture.node_loss`, the series of ``lowdiff torture --nodes N``).

Nodes A and B (one elastic agent and one gloo rank each, c10d rendezvous on 127.0.0.1)
train into one directory; once rank 1 logged its drawn step, node B is lost (agent,
trainer and checkpointing process SIGKILLed, its local directory deleted) and node C
joins as its replacement. LowDiff+ resumes from memory: B's shard from the peer copy A's
replica keeps of it (``docs/guides/failures.md``; ``lowdiff torture --nodes N`` runs
LowDiff too), at no older a step than the job acknowledged, bit-identical to an
uninterrupted run, and nothing is left running or in ``/dev/shm``.
"""

from __future__ import annotations

import pytest

from lowdiff_lab.torture.node_loss import run_node_losses

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_node_loss_resumes_from_the_peer_copy_in_memory(tmp_path, prefork):
    lines: list[str] = []
    report = run_node_losses(
        tmp_path, losses=1, seed=3, strategy="lowdiff+", log=lines.append, server=prefork
    )
    assert report.ok, "\n".join([*report.failures, *lines])
    assert report.kills == 1 and report.kills_by_target == {"node": 1}
    assert report.recoveries_by_source == {"lowdiff+ memory": 1}
    assert (report.wrong_states, report.lost_acknowledged, report.leaked) == (0, 0, 0)
