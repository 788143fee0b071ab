"""Every bad input gets a clear error that names the problem."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowdiff

N_STEPS = 5
RATIO = 0.25


class MLP(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _build(hidden: int = 16) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = MLP(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return model, opt, sched


def _ck(
    model: nn.Module, opt: Any, directory: Any, sched: Any = None, **kw: Any
) -> lowdiff.Checkpointer:
    kw.setdefault("compressor", lowdiff.TopK(ratio=RATIO))
    kw.setdefault("full_every", 4)
    kw.setdefault("batch_size", 3)
    kw.setdefault("keep_full", None)
    return lowdiff.Checkpointer(model, opt, directory, scheduler=sched, **kw)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid checkpoint directory (MLP, Adam, StepLR, TopK(0.25)) holding steps 0..5."""
    d = tmp_path_factory.mktemp("ckpt")
    model, opt, sched = _build()
    ck = _ck(model, opt, d, sched)
    try:
        assert ck.resume() == 0
        for step in range(N_STEPS):
            g = torch.Generator().manual_seed(step)
            ((model(torch.randn(6, 8, generator=g)) - 1.0) ** 2).mean().backward()
            ck.step()
            opt.zero_grad()
    finally:
        ck.close()
    assert lowdiff.inspect_dir(d).recoverable == (0, N_STEPS)
    return d


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with the bytes of the files (None for directories)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
        if p.name not in (".lowdiff.lock", ".lowdiff.writer.lock")
    }


# ----------------------------------------------------------------------------- constructor

BAD_ARGS: list[tuple[str, Callable[[nn.Module, Any, Any, Path], Any], type[Exception], str]] = [
    ("strategy", lambda m, o, s, d: _ck(m, o, d, strategy="fast"), ValueError, "method"),
    ("strategy-case", lambda m, o, s, d: _ck(m, o, d, strategy="LowDiff"), ValueError, "method"),
    ("full_every=0", lambda m, o, s, d: _ck(m, o, d, full_every=0), ValueError, "full_every"),
    ("full_every=2.5", lambda m, o, s, d: _ck(m, o, d, full_every=2.5), TypeError, "full_every"),
    ("full_every=True", lambda m, o, s, d: _ck(m, o, d, full_every=True), TypeError, "full_every"),
    ("batch_size=-1", lambda m, o, s, d: _ck(m, o, d, batch_size=-1), ValueError, "batch_size"),
    ("batch_size=0", lambda m, o, s, d: _ck(m, o, d, batch_size=0), ValueError, "batch_size"),
    ("keep_full=0", lambda m, o, s, d: _ck(m, o, d, keep_full=0), ValueError, "keep_full"),
    ("keep_full=str", lambda m, o, s, d: _ck(m, o, d, keep_full="2"), TypeError, "keep_full"),
    ("max_inflight=0", lambda m, o, s, d: _ck(m, o, d, max_inflight=0), ValueError, "max_inflight"),
    ("compressor-str", lambda m, o, s, d: _ck(m, o, d, compressor="topk"), TypeError, "compressor"),
    (
        "compressor-class",
        lambda m, o, s, d: _ck(m, o, d, compressor=lowdiff.TopK),
        TypeError,
        "compressor",
    ),
    ("model-dict", lambda m, o, s, d: _ck(m.state_dict(), o, d), TypeError, "model"),
    ("model-none", lambda m, o, s, d: _ck(None, o, d), TypeError, "model"),
    ("optimizer-list", lambda m, o, s, d: _ck(m, [o], d), TypeError, "optimizer"),
    ("scheduler-object", lambda m, o, s, d: _ck(m, o, d, object()), TypeError, "scheduler"),
    ("scheduler-optimizer", lambda m, o, s, d: _ck(m, o, d, "StepLR"), TypeError, "scheduler"),
    ("directory-none", lambda m, o, s, d: _ck(m, o, None), ValueError, "directory"),
]


@pytest.mark.parametrize(
    "make, exc, match", [a[1:] for a in BAD_ARGS], ids=[a[0] for a in BAD_ARGS]
)
def test_invalid_constructor_argument(
    tmp_path: Path, make: Any, exc: type[Exception], match: str
) -> None:
    model, opt, sched = _build()
    target = tmp_path / "ckpt"
    with pytest.raises(exc, match=match):
        make(model, opt, sched, target)
    # nothing was created on the way to the error
    assert not target.exists()


def test_invalid_compressor_arguments() -> None:
    with pytest.raises(ValueError, match="ratio"):
        lowdiff.TopK(ratio=0.0)
    with pytest.raises(ValueError, match="ratio"):
        lowdiff.RandomK(ratio=1.5)
    with pytest.raises(TypeError, match="error_feedback"):
        lowdiff.ApproxTopK(ratio=0.1, error_feedback="yes")
    with pytest.raises(ValueError, match="bits"):
        lowdiff.QSGD(bits=4)
    with pytest.raises(ValueError, match="bucket_size"):
        lowdiff.QSGD(bucket_size=0)


def test_strategy_none_accepts_no_directory_and_creates_nothing(tmp_path: Path) -> None:
    model, opt, _ = _build()
    ck = lowdiff.Checkpointer(
        tmp_path / "unused",
        model,
        opt,
        method="compression-only",
        compressor=lowdiff.TopK(ratio=0.01),
    )
    assert ck.resume() == 0
    ck.close()
    assert not (tmp_path / "unused").exists()


def test_optimizer_with_parameter_not_in_model(tmp_path: Path) -> None:
    model, _, _ = _build()
    stranger = nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    for strategy in ("lowdiff", "none"):
        with pytest.raises(ValueError, match=r"\(3, 5\).*not in the model"):
            _ck(model, opt, tmp_path / strategy, strategy=strategy)
    assert not (tmp_path / "lowdiff").exists()


@pytest.mark.parametrize("strategy", ["none", "lowdiff", "lowdiff+"])
def test_an_embedding_with_sparse_gradients_is_refused_at_construction(
    tmp_path: Path, strategy: str
) -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comp = None if strategy == "lowdiff+" else lowdiff.TopK(0.5)
    directory = None if strategy == "none" else tmp_path / "ck"
    with pytest.raises(ValueError, match=r"'0\.weight' has a sparse gradient.*sparse=False"):
        lowdiff.Checkpointer(model, opt, directory, strategy=strategy, compressor=comp)
    assert not (tmp_path / "ck").exists()


def test_sparse_gradient_is_rejected_naming_the_parameter() -> None:
    """A sparse gradient from elsewhere than an embedding module: refused at the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = lowdiff.Checkpointer(
        None, model, opt, method="compression-only", compressor=lowdiff.TopK(0.5)
    )
    ck.resume()
    model(torch.ones(3)).sum().backward()
    model[0].weight.grad = model[0].weight.grad.to_sparse()
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"'0\.weight' has a sparse gradient"):
        ck.step()
    assert torch.equal(model[0].weight, before)
    ck.close()


# ----------------------------------------------------------------------------- directories


def test_directory_holding_other_files(tmp_path: Path) -> None:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("my data\n")
    (d / "data").mkdir()
    before = sorted(p.name for p in d.rglob("*"))
    model, opt, _ = _build()
    with pytest.raises(
        lowdiff.NotACheckpointDirectoryError, match=r"notes.txt.*Use an empty or new directory"
    ):
        _ck(model, opt, d)
    with pytest.raises(
        lowdiff.NotACheckpointDirectoryError, match="not a lowdiff checkpoint directory"
    ):
        lowdiff.restore(d, model, opt)
    with pytest.raises(lowdiff.NotACheckpointDirectoryError):
        lowdiff.inspect_dir(d)
    # nothing was created in it: no lock files, no sub-directories
    assert sorted(p.name for p in d.rglob("*")) == before
    assert (d / "notes.txt").read_text() == "my data\n"


def test_path_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_bytes(b"not a directory")
    model, opt, _ = _build()
    with pytest.raises(lowdiff.NotACheckpointDirectoryError, match="is a file"):
        _ck(model, opt, f)
    with pytest.raises(lowdiff.NotACheckpointDirectoryError):
        lowdiff.restore(f, model, opt)
    assert f.read_bytes() == b"not a directory"


def test_restore_from_missing_or_empty_directory(tmp_path: Path) -> None:
    model, opt, _ = _build()
    with pytest.raises(lowdiff.NotACheckpointDirectoryError):
        lowdiff.restore(tmp_path / "missing", model, opt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(lowdiff.NotACheckpointDirectoryError, match="lowdiff.json"):
        lowdiff.restore(tmp_path / "empty", model, opt)
    assert not (tmp_path / "missing").exists()


def test_two_checkpointers_on_one_directory(tmp_path: Path) -> None:
    m1, o1, _ = _build()
    m2, o2, _ = _build()
    first = _ck(m1, o1, tmp_path)
    try:
        # held by this very process: the error says so, and what to do
        with pytest.raises(
            lowdiff.DirectoryLockedError, match="Checkpointer of this process"
        ) as info:
            _ck(m2, o2, tmp_path)
        assert f"(pid {os.getpid()})" in str(info.value) and "close()" in str(info.value)
        assert str(tmp_path) in str(info.value)
    finally:
        first.close()
    # once the first one is closed the directory is free again
    second = _ck(m2, o2, tmp_path)
    second.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+", "torch-save"])
def test_a_checkpointer_dropped_without_close_lets_go_of_the_directory(
    tmp_path: Path, strategy: str
) -> None:
    """A Checkpointer dropped without close() is collected (nothing of lowdiff's on the
    model or the optimizer keeps it alive), and a new one on the same directory, with the
    same model and optimizer (a notebook cell run again), continues where it ended."""
    import gc
    import weakref

    model, opt, _ = _build()
    kw: dict[str, Any] = {"strategy": strategy, "full_every": 4}
    if strategy == "lowdiff":
        kw.update(compressor=lowdiff.TopK(ratio=RATIO), idle_timeout=60)
    elif strategy == "lowdiff+":
        kw.update(idle_timeout=60)

    def make() -> lowdiff.Checkpointer:
        return lowdiff.Checkpointer(model, opt, tmp_path, **kw)

    ck = make()
    ck.resume()
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        ((model(torch.randn(6, 8, generator=g)) - 1.0) ** 2).mean().backward()
        ck.step()
        opt.zero_grad()
    ck.flush()
    gone = weakref.ref(ck.strategy_impl)
    del ck
    gc.collect()
    assert gone() is None, gc.get_referrers(gone())
    again = make()
    try:
        assert again.resume() == (4 if strategy == "torch-save" else 5)
    finally:
        again.close()


@pytest.mark.multiprocess
def test_manifest_deleted(ckpt_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "copy"
    shutil.copytree(ckpt_dir, d)
    (d / "lowdiff.json").unlink()
    model, opt, sched = _build()
    with pytest.raises(lowdiff.NotACheckpointDirectoryError, match="manifest was deleted"):
        lowdiff.restore(d, model, opt, sched)
    with pytest.raises(lowdiff.NotACheckpointDirectoryError, match="manifest was deleted"):
        _ck(model, opt, d, sched)
    with pytest.raises(lowdiff.NotACheckpointDirectoryError):
        lowdiff.inspect_dir(d)


# ----------------------------------------------------------------------------- mismatches


class Renamed(nn.Module):
    """The same layers as MLP, under different names."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)
        )


def _adam_steplr(model: nn.Module) -> tuple[nn.Module, Any, Any]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2)


MISMATCHES: list[
    tuple[str, Callable[[], tuple[nn.Module, Any, Any]], dict[str, Any], list[str]]
] = [
    ("shape", lambda: _build(hidden=17), {}, ["'net.0.weight'", "[16, 8]", "[17, 8]"]),
    ("names", lambda: _adam_steplr(Renamed()), {}, ["'net.0.weight'", "'layers.0.weight'"]),
    (
        "optimizer-type",
        lambda: (lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1), None))(MLP()),
        {},
        ["Adam", "SGD"],
    ),
    (
        "compressor-ratio",
        _build,
        {"compressor": lowdiff.TopK(ratio=0.5)},
        ["compressor", "0.25", "0.5"],
    ),
    (
        "compressor-kind",
        _build,
        {"compressor": lowdiff.RandomK(ratio=RATIO)},
        ["compressor", "topk", "randomk"],
    ),
    ("scheduler-missing", lambda: _build()[:2] + (None,), {}, ["scheduler", "StepLR"]),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "make, kw, needles", [m[1:] for m in MISMATCHES], ids=[m[0] for m in MISMATCHES]
)
def test_resume_mismatch(ckpt_dir: Path, make: Any, kw: dict[str, Any], needles: list[str]) -> None:
    before = _tree(ckpt_dir)
    model, opt, sched = make()
    ck = _ck(model, opt, ckpt_dir, sched, **kw)
    try:
        with pytest.raises(lowdiff.CheckpointMismatchError) as info:
            ck.resume()
    finally:
        ck.close()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"
    # a refused resume changes nothing on disk
    assert _tree(ckpt_dir) == before


@pytest.mark.multiprocess
@pytest.mark.parametrize("which", ["shape", "names", "optimizer-type"])
def test_restore_mismatch(ckpt_dir: Path, which: str) -> None:
    _, make, _, needles = next(m for m in MISMATCHES if m[0] == which)
    model, opt, sched = make()
    with pytest.raises(lowdiff.CheckpointMismatchError) as info:
        lowdiff.restore(ckpt_dir, model, opt, sched)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.multiprocess
def test_restore_into_another_scheduler_class_is_refused(ckpt_dir: Path) -> None:
    """The directory was written with StepLR: a scheduler of another class is refused
    before anything is loaded (its state would take StepLR's keys); None restores model
    and optimizer without scheduler state."""
    model, opt, _ = _build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    with pytest.raises(lowdiff.CheckpointMismatchError, match="StepLR, got .*CosineAnnealingLR"):
        lowdiff.restore(ckpt_dir, model, opt, cosine)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "step_size" not in cosine.state_dict()
    assert lowdiff.restore(ckpt_dir, model, opt, None) == N_STEPS


# ----------------------------------------------------------------------------- restore(step=...)


@pytest.mark.multiprocess
@pytest.mark.parametrize("step", [N_STEPS + 1, 1000])
def test_restore_step_out_of_range(ckpt_dir: Path, step: int) -> None:
    model, opt, sched = _build()
    with pytest.raises(
        lowdiff.RecoveryError, match=rf"step {step} is not recoverable.*0\.\.{N_STEPS}"
    ):
        lowdiff.restore(ckpt_dir, model, opt, sched, step=step)


@pytest.mark.multiprocess
@pytest.mark.parametrize("step", [-1, 2.0, True, "3"])
def test_restore_step_invalid(ckpt_dir: Path, step: Any) -> None:
    model, opt, sched = _build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="step"):
        lowdiff.restore(ckpt_dir, model, opt, sched, step=step)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_optimizer_passed_as_scheduler_is_rejected(tmp_path: Path) -> None:
    model, opt, _ = _build()
    with pytest.raises(TypeError, match="scheduler"):
        _ck(model, opt, tmp_path / "ckpt", opt)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "which", ["model-none", "model-state-dict", "scheduler-object", "directory-none"]
)
def test_restore_rejects_bad_arguments(ckpt_dir: Path, which: str) -> None:
    model, opt, sched = _build()
    args: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched}
    if which == "directory-none":
        with pytest.raises(TypeError, match="directory must be a path"):
            lowdiff.restore(None, **args)  # type: ignore[arg-type]
        return
    if which == "model-none":
        args["model"] = None
    elif which == "model-state-dict":
        args["model"] = model.state_dict()
    else:
        args["scheduler"] = object()
    name = which.split("-")[0]
    with pytest.raises(TypeError, match=name):
        lowdiff.restore(ckpt_dir, **args)


@pytest.mark.parametrize("when", ["at once", "after resume"])
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_checkpointing_process_that_cannot_start_leaves_close_clean(
    tmp_path, monkeypatch, strategy, when
):
    """A spawn that fails (as from a script without a ``__main__`` guard) raises its own
    error: from resume(), or, when the start was still going on as resume() returned (it
    overlaps the first steps), from the first request after it failed; close() then
    returns without an error of its own, and the directory is free for the next
    Checkpointer. "after resume" holds the failure until resume() returned."""
    import multiprocessing.context as mpc
    import threading

    resumed = threading.Event()
    refused = threading.Event()

    def refuse(self):
        if when == "after resume":
            assert resumed.wait(30)
        refused.set()
        raise RuntimeError("An attempt has been made to start a new process before ...")

    model, opt, _ = _build()
    # background processes start from the fork server (lowdiff.proc.spawn)
    monkeypatch.setattr(mpc.ForkServerProcess, "start", refuse)
    kw: dict[str, Any] = {"compressor": lowdiff.TopK(ratio=RATIO)} if strategy == "lowdiff" else {}
    ck = lowdiff.Checkpointer(model, opt, tmp_path / "ck", strategy=strategy, **kw)
    with pytest.raises(RuntimeError, match="start a new process"):  # noqa: PT012
        try:
            ck.resume()
        finally:
            resumed.set()
        assert when == "at once" or refused.wait(30)
        for _ in range(3):
            ((model(torch.ones(3, 8)) - 1.0) ** 2).mean().backward()
            ck.step()
            opt.zero_grad()
        ck.flush()
    assert refused.is_set()
    ck.close()  # no AssertionError, no hang
    monkeypatch.undo()
    ck2 = lowdiff.Checkpointer(model, opt, tmp_path / "ck", strategy=strategy, **kw)
    try:
        assert ck2.resume() == 0
    finally:
        ck2.close()


@pytest.mark.parametrize(
    "strategy,option,near",
    [("lowdiff", "batchsize", "records_per_file"), ("lowdiff+", "full_evry", "full_every"),
     ("torch-save", "batch_size", None)],
)  # fmt: skip
def test_an_option_the_strategy_does_not_take_is_named(
    tmp_path: Path, strategy: str, option: str, near: str | None
) -> None:
    model, opt, _ = _build()
    with pytest.raises(TypeError, match=f"takes no option '{option}'") as info:
        lowdiff.Checkpointer(model, opt, tmp_path, strategy=strategy, **{option: 3})
    text = str(info.value)
    assert f"method={strategy!r}" in text and "Options" not in text and "__init__" not in text
    assert (f"did you mean {near!r}" in text) if near else "did you mean" not in text
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("text", ['{"hello": 1}', "{}", '{"checksum": "xxh3:0", "lowdiff_m'])
def test_a_foreign_manifest_alone_is_refused_not_overwritten(tmp_path: Path, text: str) -> None:
    """A ``lowdiff.json`` that lowdiff did not write (or a torn one: lowdiff's own is
    published atomically) is refused even with nothing else beside it, and left as it is."""
    (tmp_path / "lowdiff.json").write_text(text)
    model, opt, sched = _build()
    ck = _ck(model, opt, tmp_path, sched)
    try:
        with pytest.raises(lowdiff.CorruptCheckpointError, match="lowdiff.json"):
            ck.resume()
    finally:
        ck.close()
    assert (tmp_path / "lowdiff.json").read_text() == text


def _rewrite_as_version(path: Path, version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrite the lowdiff file ``path`` as a (valid, checksummed) file of ``version``."""
    from lowdiff.format import sfile

    loaded = sfile.read(path)
    meta = dict(loaded.metadata)
    tensors = {k: v.clone() for k, v in loaded.tensors.items()}
    with monkeypatch.context() as m:
        m.setattr(sfile, "FORMAT_VERSION", version)
        entries, blob = sfile.pack(tensors)
        sfile.write(path, entries, blob, meta)


@pytest.mark.multiprocess
def test_a_newer_lowdiffs_directory_is_refused_whole(
    ckpt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/format.md: a reader refuses newer versions. A manifest or a record file of a
    newer format version is refused by resume(), restore() and inspect, naming the file,
    and nothing is rewritten or quarantined (it is not damage)."""
    from lowdiff.format import layout

    newer_manifest = tmp_path / "manifest"
    shutil.copytree(ckpt_dir, newer_manifest)
    body = dict(layout.read_manifest(newer_manifest), format_version=2)
    layout.write_manifest(newer_manifest, body)
    newer_record = tmp_path / "record"
    shutil.copytree(ckpt_dir, newer_record)
    rec = sorted((newer_record / "records").glob("rec-*"))[-1]
    _rewrite_as_version(rec, 2, monkeypatch)
    for d, named in ((newer_manifest, "lowdiff.json"), (newer_record, rec.name)):
        before = _tree(d)
        model, opt, sched = _build()
        with pytest.raises(lowdiff.NewerFormatError, match=f"{named}: format version 2 is newer"):
            lowdiff.restore(d, model, opt, sched)
        with pytest.raises(lowdiff.NewerFormatError, match="upgrade lowdiff"):
            lowdiff.inspect_dir(d)
        ck = _ck(model, opt, d, sched)
        try:
            with pytest.raises(lowdiff.NewerFormatError, match=named):
                ck.resume()
        finally:
            ck.close()
        assert _tree(d) == before
        assert not (d / "quarantine").exists()


@pytest.mark.parametrize("drive", ["step", "attach"])
def test_a_parameter_group_added_after_construction_is_refused(tmp_path: Path, drive: str) -> None:
    """optimizer.add_param_group() after the Checkpointer was built: refused at the next
    step, before anything of it is recorded (every step before stays restorable)."""
    model, opt, sched = _build()
    extra = nn.Linear(2, 2)
    make = lowdiff.attach if drive == "attach" else lowdiff.Checkpointer
    ck = make(model, opt, tmp_path, scheduler=sched, compressor=lowdiff.TopK(0.5), full_every=2)
    ck.resume()

    def update() -> None:
        ((model(torch.ones(3, 8)) - 1.0) ** 2).mean().backward()
        if drive == "attach":
            opt.step()
            sched.step()
        else:
            ck.step()
        opt.zero_grad()

    try:
        update()
        update()
        opt.add_param_group({"params": list(extra.parameters())})
        with pytest.raises(lowdiff.UnsupportedSetupError, match="add_param_group"):
            update()
    finally:
        ck.close()
    m2, o2, s2 = _build()
    # under attach step 2 was still waiting for the next update's hand-over: not saved
    assert lowdiff.restore(tmp_path, m2, o2, s2) == (1 if drive == "attach" else 2)


def test_lowdiff_plus_refuses_frozen_parameters_in_the_optimizer(tmp_path: Path) -> None:
    model, _, _ = _build()
    next(model.parameters()).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(lowdiff.UnsupportedSetupError, match="do not require a gradient"):
        lowdiff.Checkpointer(tmp_path / "ck", model, opt, method="lowdiff+")
    assert not (tmp_path / "ck").exists()
    # without them it works
    opt = torch.optim.Adam(p for p in model.parameters() if p.requires_grad)
    lowdiff.Checkpointer(tmp_path / "ck2", model, opt, method="lowdiff+").close()


def test_step_of_a_closed_attached_checkpointer_says_closed(tmp_path: Path) -> None:
    model, opt, sched = _build()
    ck = lowdiff.attach(tmp_path, model, opt, scheduler=sched, compressor=lowdiff.TopK(0.5))
    ck.resume()
    ck.close()
    with pytest.raises(RuntimeError, match=r"step\(\) after close\(\)"):
        ck.step()
