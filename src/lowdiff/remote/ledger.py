"""What a remote tier holds committed, as its uploader knows it: the durable step, and
the retention that keeps it.

The uploader tells its :class:`RemoteLedger` of each file committed (or found committed
with the same bytes at its start); the ledger computes the newest step the remote tier
can recover (:func:`reach`: from a committed full checkpoint through committed record
files without a gap) and reports it whenever it grows. After each full checkpoint the
uploader applies the remote's retention through it (:meth:`RemoteLedger.retain`): the
newest ``keep_full`` committed full checkpoints stay, with the record files that reach
them.
"""

from __future__ import annotations

from collections.abc import Callable

from lowdiff.format import layout
from lowdiff.remote.store import RemoteStore


def reach(fulls: set[int], records: set[tuple[int, int]]) -> int:
    """The newest step recoverable from full checkpoints at ``fulls`` and record files
    ``(first, last)``, or -1: from a full checkpoint at F, a file with ``first <= s <=
    last`` takes step ``s`` to ``last + 1``.

    Example:
        >>> reach({0}, {(0, 2), (3, 5), (7, 8)})
        6
    """
    best = -1
    by_first = sorted(records)
    for f in fulls:
        cur, moved = f, True
        while moved:
            moved = False
            for first, last in by_first:
                if first <= cur <= last:
                    cur, moved = last + 1, True
        best = max(best, cur)
    return best


class RemoteLedger:
    """The full checkpoints and record files of one remote tier known committed, and the
    durable step they reach (``on_durable`` is called with it whenever it grows)."""

    def __init__(self, on_durable: Callable[[int], None]) -> None:
        self.on_durable = on_durable
        self.fulls: set[int] = set()
        self.records: set[tuple[int, int]] = set()
        self.durable = -1

    def committed(self, name: str) -> None:
        """The file ``name`` (``full/...`` or ``records/...``) is committed."""
        folder, _, base = name.partition("/")
        if folder == layout.FULL_DIR:
            s = layout.parse_full_name(base)
            if s is not None:
                self.fulls.add(s)
        elif folder == layout.RECORDS_DIR:
            r = layout.parse_records_name(base)
            if r is not None:
                self.records.add(r)

    def report(self) -> None:
        """Report the durable step if it grew."""
        d = reach(self.fulls, self.records)
        if d > self.durable:
            self.durable = d
            self.on_durable(d)

    def retain(
        self,
        store: RemoteStore,
        keep_full: int,
        job: RemoteStore | None = None,
        siblings: tuple[str, ...] = (),
    ) -> None:
        """Keep the newest ``keep_full`` committed full checkpoints of ``store`` and the
        record files that reach them; unpublish the rest (commit first, then data).

        In a distributed job (``siblings``: the folders of every shard of the generation
        under ``job``, the job's tier) nothing goes past the newest full checkpoint that
        every shard has committed (:func:`job_floor`)."""
        fulls = store.fulls()[0]
        steps = sorted(fulls)
        if len(steps) <= keep_full:
            return
        oldest_kept = steps[-keep_full]
        if siblings:
            assert job is not None
            oldest_kept = min(oldest_kept, job_floor(job, siblings))
        for r, c in store.records()[0].items():
            if r[1] < oldest_kept:
                store.delete(c.name)
                self.records.discard(r)
        for s in steps:
            if s < oldest_kept:
                store.delete(fulls[s].name)
                self.fulls.discard(s)


def job_floor(job: RemoteStore, siblings: tuple[str, ...]) -> int:
    """The newest full checkpoint every shard (``siblings``, folders under the job's tier
    ``job``) has committed (0 when none is common, or a shard cannot be listed: nothing
    goes). The argument of :func:`lowdiff.engine.process.full_writer.job_retention_floor` holds here
    too: each shard commits in step order and deletes only below a step it has seen in
    every shard."""
    common: set[int] | None = None
    for rel in siblings:
        try:
            steps = set(job.sub(rel).fulls()[0])
        except Exception:  # noqa: BLE001 -- any failure of the store: keep everything
            return 0
        common = steps if common is None else common & steps
    return max(common) if common else 0
