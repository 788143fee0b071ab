"""Finding what a checkpoint directory can recover, and how.

``scan`` reads only file names and headers (cheap). Checksums of the data are verified
when a file is actually used (during replay) and by ``lowdiff verify``.

A *plan* for a target step ``T`` is a full checkpoint ``F <= T`` plus the record files
that hold records ``F .. T-1`` without a gap. Record files may straddle a full
checkpoint (a batch ``[29, 31]`` serves ``F = 30`` from its second record on).

Lineage: every file names the run (session) that wrote it (``run_id``), and a record file
also names the run whose state its first record follows (``follows``). A chain only
takes a record file at step ``t`` when the run it follows there (``follows`` when
``t`` is its first step, else its own ``run_id``) is the run that produced the state at
``t``: files of an abandoned trajectory that reappear after a power loss never mix with
the resumed one. A file without ``follows`` (older format) chains as before.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from lowdiff.errors import (
    CorruptCheckpointError,
    NewerFormatError,
    NotACheckpointDirectoryError,
    RecoveryError,
)
from lowdiff.format import layout, sfile
from lowdiff.format.atomic import TMP_PREFIX
from lowdiff.recovery.directory import check_directory  # lowdiff.engine imports it from here
from lowdiff.recovery.directory import (
    is_empty_dir as is_empty_dir,  # re-exported: lowdiff.engine imports it from here
)


@dataclass
class FileInfo:
    """One full checkpoint or record file."""

    path: Path
    kind: str
    first_step: int
    last_step: int
    nbytes: int
    n_records: int
    run_id: str | None = None
    """The run that wrote the file (None: not recorded)."""
    follows: str | None = None
    """Record files: the run whose state at ``first_step`` the first record follows
    (None: unknown, a file written before lineage was recorded)."""

    def predecessor(self, step: int) -> str | None:
        """The run whose state at ``step`` the record of ``step`` in this file follows."""
        return self.follows if step == self.first_step else self.run_id


@dataclass
class Scan:
    root: Path
    manifest: dict
    fulls: list[FileInfo] = field(default_factory=list)
    records: list[FileInfo] = field(default_factory=list)
    problems: list[tuple[Path, str]] = field(default_factory=list)


@dataclass
class Foreign:
    """A file that recovery left out because it belongs to another trajectory."""

    file: FileInfo
    step: int
    """Where it parts from the chain: the step at which the chain could have taken it, or
    the step after which its run's trajectory was abandoned."""
    reason: str

    def describe(self) -> str:
        return f"{self.file.path} {self.reason}"


@dataclass
class Chain:
    """The longest lineage-consistent chain of record files from one state."""

    reach: int
    files: list[FileInfo]
    foreign: list[Foreign]
    """Record files of other trajectories the chain passed over (at steps ``<= reach``)."""

    def foreign_until(self, target: int) -> list[Foreign]:
        """The foreign files that mattered for a recovery to ``target``: passed over
        before it, or (when the chain ends at ``target``) the ones that ended it."""
        return [x for x in self.foreign if x.step < target or x.step == target == self.reach]


@dataclass
class Plan:
    full: FileInfo
    target: int
    record_files: list[FileInfo]
    foreign: list[Foreign] = field(default_factory=list)
    """Record files of another trajectory passed over on the way to ``target``."""


def scan(root: str | Path) -> Scan:
    """List and header-check every checkpoint file under ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise NotACheckpointDirectoryError(f"{root} does not exist or is not a directory")
    check_directory(root, advice="")
    if not (root / layout.MANIFEST).exists():
        raise NotACheckpointDirectoryError(
            f"{root} holds no lowdiff checkpoint (no {layout.MANIFEST})"
        )
    manifest = layout.read_manifest(root)
    if manifest.get("format") != sfile.FORMAT_NAME:
        raise NotACheckpointDirectoryError(
            f"{root}: its manifest is of format {manifest.get('format')!r}, not a lowdiff "
            "checkpoint directory's"
        )
    out = Scan(root, manifest)
    for sub, kind in ((layout.FULL_DIR, "full"), (layout.RECORDS_DIR, "records")):
        d = root / sub
        if not d.is_dir():
            if d.exists() or d.is_symlink():
                out.problems.append((d, f"{sub} is not a directory (a foreign file?)"))
            continue
        for p in sorted(d.iterdir()):
            if p.name.startswith(TMP_PREFIX):
                continue
            try:
                out_info = _header_info(p, kind, manifest)
            except NewerFormatError:
                raise  # a newer lowdiff's directory: refused whole, nothing passed over
            except CorruptCheckpointError as e:
                out.problems.append((p, e.reason))
                continue
            (out.fulls if kind == "full" else out.records).append(out_info)
    out.fulls.sort(key=lambda f: f.first_step)
    out.records.sort(key=lambda f: (f.first_step, f.last_step))
    return out


def _check_kind(p: Path, found: str | None, want: str) -> None:
    if found != want:
        raise CorruptCheckpointError(
            p, f"kind {found!r} in a file named as a {want!r} file (expected kind {want!r})"
        )


def _check_origin(p: Path, md: dict[str, str], manifest: dict) -> None:
    """Refuse a file written for another directory: another model layout than the
    manifest's, or a run the manifest does not list (``runs``; a directory whose manifest
    predates the list checks the layout alone)."""
    mine, theirs = manifest.get("layout_id"), md.get("layout_id")
    if mine is not None and theirs is not None and mine != theirs:
        raise CorruptCheckpointError(
            p,
            f"written for another model layout (layout {theirs}, this directory's is {mine}): "
            "a file from another run",
        )
    runs, run = manifest.get("runs"), md.get("run_id")
    if isinstance(runs, list) and run and run not in runs:
        raise CorruptCheckpointError(
            p,
            f"written by run {run}, which is none of this directory's runs "
            f"({len(runs)} in its manifest): a file from another run, or a damaged header",
        )


def _header_info(p: Path, kind: str, manifest: dict) -> FileInfo:
    if kind == "full":
        step = layout.parse_full_name(p.name)
        if step is None:
            raise CorruptCheckpointError(p, "unexpected file name in full/ (a foreign file?)")
        hdr = sfile.read_header(p)
        _check_kind(p, hdr.kind, "full")
        if hdr.metadata.get("step") != str(step):
            raise CorruptCheckpointError(p, "metadata does not match the file name")
        _check_origin(p, hdr.metadata, manifest)
        return FileInfo(
            p, "full", step, step, hdr.file_size, 0, run_id=hdr.metadata.get("run_id") or None
        )
    rng = layout.parse_records_name(p.name)
    if rng is None:
        raise CorruptCheckpointError(p, "unexpected file name in records/ (a foreign file?)")
    hdr = sfile.read_header(p)
    _check_kind(p, hdr.kind, "records")
    md = hdr.metadata
    if md.get("first_step") != str(rng[0]) or md.get("last_step") != str(rng[1]):
        raise CorruptCheckpointError(p, "metadata does not match the file name")
    n = rng[1] - rng[0] + 1
    if md.get("n_records") != str(n):
        raise CorruptCheckpointError(p, "record count does not match the steps it covers")
    _check_origin(p, md, manifest)
    return FileInfo(
        p,
        "records",
        rng[0],
        rng[1],
        hdr.file_size,
        n,
        run_id=md.get("run_id") or None,
        follows=md.get("follows") or None,
    )


def _full_run(s: Scan, start: int, exclude: AbstractSet[Path]) -> str | None:
    """The run that wrote the full checkpoint at ``start`` (None: none there, or unknown)."""
    for f in s.fulls:
        if f.first_step == start and f.path not in exclude:
            return f.run_id
    return None


_State = tuple[int, str | None]
"""A state a chain reaches: its step and the run that produced it (None: unknown)."""
_Moves = dict[_State, list[tuple[FileInfo, _State]]]


def search_chain(
    s: Scan, start: int, origin: str | None, exclude: AbstractSet[Path] = frozenset()
) -> Chain:
    """The longest chain of record files from the state at ``start``, lineage checked.

    ``origin`` is the run that produced the state at ``start`` (the ``run_id`` of the full
    checkpoint it was loaded from; None: unknown). A record file is taken at step ``t`` only when its
    :meth:`FileInfo.predecessor` at ``t`` is that state's run (either one unknown: taken).
    Among the ways forward the one reaching furthest wins; ties go to the file with the
    smallest first step and then the most records (the order recovery always used).
    """
    files = sorted(
        (f for f in s.records if f.path not in exclude), key=lambda f: (f.first_step, -f.last_step)
    )
    moves, rejected = _ways_forward(files, (start, origin))
    # every move goes to a later step: settle the states from the last step back
    best: dict[_State, tuple[int, int]] = {}  # state -> (reach, index of the move taken or -1)
    for state in sorted(moves, key=lambda x: x[0], reverse=True):
        reach, pick = state[0], -1
        for i, (_, nxt) in enumerate(moves[state]):
            if best[nxt][0] > reach:
                reach, pick = best[nxt][0], i
        best[state] = (reach, pick)
    used: list[FileInfo] = []
    foreign: list[Foreign] = []
    state = (start, origin)
    while True:
        foreign.extend(
            x for x in rejected[state] if x.file.path not in {y.file.path for y in foreign}
        )
        pick = best[state][1]
        if pick < 0:
            break
        f, state = moves[state][pick]
        used.append(f)
    return Chain(best[(start, origin)][0], used, foreign)


def _ways_forward(
    files: list[FileInfo], first: _State
) -> tuple[_Moves, dict[_State, list[Foreign]]]:
    """Every state reachable from ``first`` through ``files`` (sorted by first step), with
    the files that take each one further (and the state each leads to), and the files
    that would hold its step but follow another run there (rejected, named)."""
    firsts = [f.first_step for f in files]
    longest = max((f.last_step - f.first_step for f in files), default=0)
    moves: _Moves = {}
    rejected: dict[_State, list[Foreign]] = {}
    todo: list[_State] = [first]
    while todo:
        state = todo.pop()
        if state in moves:
            continue
        step, owner = state
        ok: list[tuple[FileInfo, _State]] = []
        bad: list[Foreign] = []
        lo = bisect.bisect_left(firsts, step - longest)
        hi = bisect.bisect_right(firsts, step)
        for f in files[lo:hi]:
            if not f.first_step <= step <= f.last_step:
                continue
            pred = f.predecessor(step)
            if owner is not None and pred is not None and pred != owner:
                why = (
                    f"follows run {pred} at step {step}, but the state at step {step} comes "
                    f"from run {owner}: another trajectory, not chained"
                )
                bad.append(Foreign(f, step, why))
                continue
            nxt = (f.last_step + 1, f.run_id)
            ok.append((f, nxt))
            todo.append(nxt)
        moves[state], rejected[state] = ok, bad
    return moves, rejected


def chain_from(
    s: Scan, start: int, exclude: AbstractSet[Path] = frozenset()
) -> tuple[int, list[FileInfo]]:
    """Follow records from the full checkpoint at ``start`` without a gap and within one
    trajectory (see :func:`search_chain`); returns (reachable step, files used)."""
    exclude = usable(s, exclude)
    c = search_chain(s, start, _full_run(s, start, exclude), exclude)
    return c.reach, c.files


def abandoned(s: Scan, exclude: AbstractSet[Path] = frozenset()) -> dict[Path, Foreign]:
    """Files of abandoned trajectories, which recovery leaves out.

    A record file of run ``R`` that follows another run ``P`` at step ``t`` says that
    ``R`` resumed from ``P``'s state at ``t``: when ``R`` started, nothing of ``P`` past
    ``t`` was recoverable, so ``P``'s later states belong to a trajectory given up then.
    ``P``'s full checkpoints after ``t`` and its record files holding records from ``t``
    on are abandoned (they reappear after a power loss undid their quarantine, or were
    written by ``P``'s checkpointing process after ``R`` had resumed).

    Nothing is left out when no usable full checkpoint would remain: an abandoned state
    is still a consistent one (recovery then follows its lineage as far as it goes).
    """
    resumed: dict[str, FileInfo] = {}  # run -> the earliest file of a run resuming from it
    for f in s.records:
        if f.path in exclude or not (f.follows and f.run_id) or f.follows == f.run_id:
            continue
        cur = resumed.get(f.follows)
        if cur is None or f.first_step < cur.first_step:
            resumed[f.follows] = f
    out: dict[Path, Foreign] = {}
    for f in s.fulls + s.records:
        by = resumed.get(f.run_id) if f.run_id and f.path not in exclude else None
        if by is None:
            continue
        t = by.first_step
        if (f.kind == "full" and f.first_step > t) or (f.kind == "records" and f.last_step >= t):
            out[f.path] = Foreign(
                f,
                t,
                f"was written by run {f.run_id} past step {t}, but run {by.run_id} resumed "
                f"from run {f.run_id}'s state at step {t} ({by.path.name}): an abandoned "
                "trajectory, not chained",
            )
    if not any(f.path not in exclude and f.path not in out for f in s.fulls):
        return {}
    return out


def usable(s: Scan, exclude: AbstractSet[Path] = frozenset()) -> AbstractSet[Path]:
    """``exclude`` and the files of abandoned trajectories (see :func:`abandoned`)."""
    gone = abandoned(s, exclude)
    return exclude | gone.keys() if gone else exclude


def recoverable_intervals(
    s: Scan, exclude: AbstractSet[Path] = frozenset()
) -> list[tuple[int, int]]:
    """Recoverable steps as sorted, disjoint inclusive intervals (by headers alone)."""
    exclude = usable(s, exclude)
    spans = sorted(
        (f.first_step, search_chain(s, f.first_step, f.run_id, exclude).reach)
        for f in s.fulls
        if f.path not in exclude
    )
    return merge_intervals(spans)


def merge_intervals(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Inclusive step intervals as sorted, disjoint ones (adjacent ones joined)."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def recoverable_range(s: Scan, exclude: AbstractSet[Path] = frozenset()) -> tuple[int, int] | None:
    """(oldest, newest) recoverable step by headers alone, or None. See also
    :func:`recoverable_intervals`: steps inside a gap between the two are not recoverable."""
    iv = recoverable_intervals(s, exclude)
    return (iv[0][0], iv[-1][1]) if iv else None


def describe_intervals(iv: list[tuple[int, int]]) -> str:
    return ", ".join(f"{lo}..{hi}" for lo, hi in iv) if iv else "none"


def make_plan(s: Scan, target: int | None, exclude: AbstractSet[Path] = frozenset()) -> Plan:
    """Choose the full checkpoint and records that reach ``target`` (None: the newest step)."""
    gone = abandoned(s, exclude)
    exclude = exclude | gone.keys() if gone else exclude
    fulls = [f for f in s.fulls if f.path not in exclude]
    if not fulls:
        raise RecoveryError(f"{s.root}: no usable full checkpoint" + _problems_suffix(s))
    options = []
    for f in fulls:
        c = search_chain(s, f.first_step, f.run_id, exclude)
        options.append((c.reach, f, c))
    if target is None:
        reach, f, c = max(options, key=lambda o: (o[0], o[1].first_step))
        return Plan(f, reach, c.files, passed_over(gone, c, f.first_step, reach))
    candidates = [o for o in options if o[1].first_step <= target <= o[0]]
    if not candidates:
        iv = recoverable_intervals(s, exclude)
        have = f"recoverable steps are {describe_intervals(iv)}" if iv else "nothing is recoverable"
        left_out = {
            x.file.path: x
            for x in [*(x for *_, c in options for x in c.foreign), *gone.values()]
            if x.file.first_step <= target
        }
        raise RecoveryError(
            f"{s.root}: step {target} is not recoverable; {have}"
            + _problems_suffix(s)
            + _foreign_suffix(left_out.values())
        )
    _, f, c = max(candidates, key=lambda o: o[1].first_step)
    files = [r for r in c.files if r.first_step < target]
    return Plan(f, target, files, passed_over(gone, c, f.first_step, target))


def passed_over(gone: dict[Path, Foreign], chain: Chain, start: int, target: int) -> list[Foreign]:
    """The files of other trajectories that a recovery from ``start`` to ``target`` left
    out: abandoned files among those steps, and the chain's rejected record files."""
    out = {
        p: x for p, x in gone.items() if x.file.first_step <= target and x.file.last_step >= start
    }
    for x in chain.foreign_until(target):
        out.setdefault(x.file.path, x)
    return list(out.values())


def _foreign_suffix(left_out: Iterable[Foreign]) -> str:
    parts = [f"{x.file.path.name} {x.reason}" for x in left_out]
    return " (left out, of another trajectory: " + "; ".join(parts) + ")" if parts else ""


def _problems_suffix(s: Scan) -> str:
    if not s.problems:
        return ""
    return " (left out: " + "; ".join(f"{p.name}: {why}" for p, why in s.problems) + ")"
