"""Export the state at any recoverable step in the formats other tools load.

No training code is needed: a stand-in model (the checkpoint's parameter and buffer names,
shapes and dtypes) and an optimizer of the recorded ``torch.optim`` class are built from
the checkpoint's headers, and recovery restores them to the step (for a distributed job,
from every shard, with rank 0's buffers). Then one of:

- ``safetensors``: the model state dict as one safetensors file (lowdiff's ``export`` kind);
- ``torch``: one ``torch.save`` file, ``{"model", "optimizer", "scheduler", "step"}``, that
  the usual ``model.load_state_dict(ckpt["model"])`` resume code reads;
- ``dcp``: a ``torch.distributed.checkpoint`` directory holding ``"model"`` and
  ``"optimizer"`` in the conventions of ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` (parameters named by their fully qualified names), plus
  ``"step"`` and, when training used one, ``"scheduler"``;
- ``hf``: for a ``transformers`` model whose config training recorded in the manifest
  (``model_config``, JSON), a ``save_pretrained`` directory that
  ``AutoModel*.from_pretrained`` loads.

Nothing under the checkpoint directory is written; the output appears whole or not at all
(written under a temporary name beside it, then renamed).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import stat
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lowdiff.ddp.shard import merge_state_dicts
from lowdiff.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointDirectoryError,
    RecoveryError,
)
from lowdiff.format import codec, layout, sfile
from lowdiff.format.atomic import nearest_existing
from lowdiff.recovery.fsdp2 import newest_fsdp2_state
from lowdiff.recovery.job import serving_generation
from lowdiff.recovery.job_layout import generations, is_job_dir, job_sharding
from lowdiff.recovery.restore import recover
from lowdiff.recovery.scan import make_plan, scan
from lowdiff.recovery.shards import plan_sharded, scan_dirs, shard_files
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state import capture as st
from lowdiff.state.model_config import MODEL_CONFIG_KEY, model_config_entry
from lowdiff.state.record import RecordLayout
from lowdiff.state.sharded import FSDP2

__all__ = [
    "FORMATS",
    "MODEL_CONFIG_KEY",
    "export",
    "fqn_optimizer_state_dict",
    "model_config_entry",
    "rebuild",
]

FORMATS = ("safetensors", "torch", "dcp", "hf")
"""What :func:`export` writes (``format=``)."""


class _SchedulerState:
    """Takes the scheduler state recovery restores, for the formats that carry it."""

    takes_any_scheduler_state = True
    """Recovery's class check lets it stand in for the scheduler the checkpoint names."""

    def __init__(self) -> None:
        self.state: Any = None

    def step(self) -> None:  # pragma: no cover - recovery never steps a scheduler
        raise NotImplementedError

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def _set_path(
    root: torch.nn.Module, name: str, value: torch.Tensor | torch.nn.Parameter, is_param: bool
) -> None:
    *parents, leaf = name.split(".")
    mod = root
    for part in parents:
        child = getattr(mod, part, None) if part in mod._modules else None
        if child is None:
            child = torch.nn.Module()
            mod.add_module(part, child)
        mod = child
    if is_param:
        mod.register_parameter(leaf, value)  # type: ignore[arg-type]
    else:
        mod.register_buffer(leaf, value)


def _optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    module, _, cls = name.rpartition(".")
    if not (module == "torch.optim" or module.startswith("torch.optim.")):
        raise CheckpointMismatchError(
            f"this checkpoint was written with optimizer {name}; export without the training code supports "
            "torch.optim optimizers only (use lowdiff.restore with your own model and optimizer)"
        )
    obj = getattr(importlib.import_module(module), cls, None)
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise CheckpointMismatchError(f"{name} is not a torch.optim optimizer")
    return obj


def _full_headers(root: Path, step: int | None) -> tuple[list[sfile.Header], list[RecordLayout]]:
    """Headers of the full checkpoints recovery to ``step`` starts from (one per shard),
    and the shards' record layouts. Raises :class:`RecoveryError` for a step not served."""
    g = serving_generation(root, step) if is_job_dir(root) else None
    if g is not None and not g.single:
        scans = scan_dirs(g.root, g.shard_dirs())
        target, full = plan_sharded(scans, step)
        fulls = [shard_files(sc, full, target, frozenset())[0] for sc in scans]
    else:  # a single process's directory (or generation 0 of a job that resumed one)
        sc = scan(root)
        scans, fulls = [sc], [make_plan(sc, step).full]
    rls = [RecordLayout.from_json(sc.manifest["record_layout"]) for sc in scans]
    return [sfile.read_header(f.path) for f in fulls], rls


def _fsdp2_headers(root: Path, step: int | None) -> tuple[list[sfile.Header], list[RecordLayout]]:
    """An FSDP2 job's shards joined (:mod:`lowdiff.recovery.fsdp2`), described as one
    full checkpoint of whole tensors over all the parameters."""
    tensors, md, step, g = newest_fsdp2_state(root, step)
    entries, size = sfile.plan((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
    rl = RecordLayout.from_json(layout.read_manifest(g.shard_dirs()[0])["record_layout"])
    shapes = {f"model/{p.name}": tuple(tensors[f"model/{p.name}"].shape) for p in rl.params}
    rl.params = [dataclasses.replace(p, shape=shapes[f"model/{p.name}"]) for p in rl.params]
    return [sfile.Header(root, md, entries, 0, size)], [rl]


def rebuild(
    path: str | Path, step: int | None, scheduler: Any | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, RecoveryStats]:
    """A stand-in model and optimizer built from the checkpoint alone, restored to ``step``.

    Works on a single-process directory and on a distributed job's (every shard, rank 0's
    per-rank state). ``scheduler``, when given, receives the scheduler state.
    """
    root = Path(path)
    if is_job_dir(root) and job_sharding(root) == FSDP2:
        headers, rls = _fsdp2_headers(root, step)
    else:
        headers, rls = _full_headers(root, step)
    shapes, osds = _shapes_and_optim(headers, rls)
    own = headers[0].metadata
    aliases = {
        st.canonical_name(a): st.canonical_name(c)
        for a, c in json.loads(own["model_aliases"]).items()
    }
    bnames = {st.canonical_name(n) for n, _, _ in rls[0].buffers}
    model, params = _stand_in_model(shapes, aliases, bnames)
    merged = merge_state_dicts(osds, 0)
    ordered_names = [
        st.canonical_name(p.name) for p in sorted((p for rl in rls for p in rl.params), key=_index)
    ]
    missing = [n for n in ordered_names if n not in params]
    if missing:
        raise CorruptCheckpointError(
            headers[0].path, f"parameters missing from the full checkpoints: {missing[:3]}"
        )
    ordered = [params[n] for n in ordered_names]
    groups = []
    for g in merged["param_groups"]:
        hp = {k: v for k, v in g.items() if k != "params"}
        groups.append({"params": [ordered[i] for i in g["params"]], **hp})
    manifest = _first_manifest(root)
    cls = _optimizer_class(manifest["optimizer"])
    optimizer = cls(groups)  # type: ignore[call-arg]  # torch.optim classes default their hyperparameters
    stats = recover(root, model, optimizer, scheduler, step)
    return model, optimizer, stats


def _shapes_and_optim(
    headers: list[sfile.Header], rls: list[RecordLayout]
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], list[tuple[dict[str, Any], list[int]]]]:
    """The dtype and shape of every model tensor, by canonical name (shard 0's, and the
    parameters each other shard owns), and each shard's optimizer state dict (tensors
    left empty) with the indices of the parameters it holds."""
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    osds = []
    for s, (h, rl) in enumerate(zip(headers, rls, strict=True)):
        mine = {st.canonical_name(p.name) for p in rl.params}
        for e in h.entries:
            if e.name.startswith("model/"):
                # canonical: a compiled model's checkpoint of before names were
                name = st.canonical_name(e.name[len("model/") :])
                if s == 0 or name in mine:  # other shards: only the parameters they own
                    shapes[name] = (e.dtype, e.shape)
        try:
            osd = codec.loads(h.metadata["optim"], lambda _: torch.empty(0))
            shard = codec.loads(h.metadata.get("shard", "null"))
        except (KeyError, ValueError) as e:
            raise CorruptCheckpointError(h.path, f"bad optimizer metadata ({e})") from None
        osds.append((osd, shard if isinstance(shard, list) else [p.index for p in rl.params]))
    return shapes, osds


def _stand_in_model(
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    aliases: dict[str, str],
    bnames: set[str],
) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]:
    """A module holding a zero tensor of every shape under its name (a buffer for the
    names in ``bnames``, else a parameter), and each alias as a second name of its
    tensor; returns it and its parameters by name."""
    model = torch.nn.Module()
    params: dict[str, torch.nn.Parameter] = {}
    for name, (dtype, shape) in shapes.items():
        t = torch.zeros(shape, dtype=dtype)
        if name in bnames:
            _set_path(model, name, t, False)
        else:  # optimized, or frozen (in the state dict but not in the optimizer)
            params[name] = torch.nn.Parameter(t, requires_grad=t.is_floating_point())
            _set_path(model, name, params[name], True)
    for alias, canon in aliases.items():
        _set_path(model, alias, params[canon], canon in params)
    return model, params


def _index(p: Any) -> int:
    return int(p.index)


def _first_manifest(root: Path) -> dict[str, Any]:
    """The manifest with the training settings: rank 0's of the newest generation for a
    distributed job."""
    return layout.read_manifest(generations(root)[-1].shard_dirs()[0] if is_job_dir(root) else root)


def export(
    directory: str | Path,
    step: int | None = None,
    out: str | Path | None = None,
    *,
    format: str = "safetensors",  # noqa: A002 -- the name users know from the CLI
) -> int:
    """Write the state at ``step`` (None: the newest recoverable step) to ``out``.

    Args:
        directory: a lowdiff checkpoint directory, or a distributed job's (any world size).
        step: a recoverable step (for a job: one every shard serves); None: the newest.
        out: the file (``safetensors``, ``torch``) or directory (``dcp``, ``hf``) to write;
            a directory must not exist yet or be empty, a file may exist (it is replaced
            whole), and missing parent directories are created.
        format: one of :data:`FORMATS`; see the module docstring.

    Returns:
        The exported step.

    Raises:
        ValueError: an unknown format, no ``out``, or an ``out`` inside the checkpoint
            directory, a directory for a file format, a non-empty directory, or under a
            path that is a file.
        CheckpointMismatchError: ``hf`` for a checkpoint without a recorded model config.
        RecoveryError: ``step`` is not recoverable.

    Example:
        >>> lowdiff.export("runs/ckpt", step=120, format="torch", out="step120.pt")  # doctest: +SKIP
        120
    """
    if format not in FORMATS:
        raise InvalidArgumentError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")
    if out is None:
        raise InvalidArgumentError("out is required: the file or directory to write")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise InvalidArgumentError(f"step must be a non-negative int or None, got {step!r}")
    root, dest = Path(directory), Path(out)
    if not root.is_dir():
        raise NotACheckpointDirectoryError(f"{root} does not exist or is not a directory")
    if dest.resolve().is_relative_to(root.resolve()):
        raise InvalidArgumentError(f"out must lie outside the checkpoint directory {root}, got {dest}")
    _check_out(dest, format)
    if not (is_job_dir(root) and job_sharding(root) == FSDP2):
        _full_headers(root, step)  # cheap: a directory lowdiff reads, and a step it serves
    hf_config = _hf_config(root) if format == "hf" else None
    sched = _SchedulerState()
    model, optimizer, stats = rebuild(root, step, sched if _has_scheduler(root) else None)
    if format == "safetensors":
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dest.parent.mkdir(parents=True, exist_ok=True)
        sfile.write_tensors(dest, sd, {"kind": "export", "step": str(stats.step)})
    elif format == "torch":
        _publish(dest, lambda tmp: _write_torch(tmp, model, optimizer, sched.state, stats.step))
    elif format == "dcp":
        _publish(dest, lambda tmp: _write_dcp(tmp, model, optimizer, sched.state, stats.step))
    else:
        assert hf_config is not None
        _publish(dest, lambda tmp: _write_hf(tmp, model, hf_config))
    return stats.step


def _check_out(dest: Path, format: str) -> None:
    """Refuse an ``out`` the format cannot be written to, before any work: a file format
    (``safetensors``, ``torch``) never replaces a directory, a directory format (``dcp``,
    ``hf``) only an empty one; a missing parent is created, a file in its place is not."""
    if format in ("dcp", "hf"):
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise InvalidArgumentError(f"out {dest} exists and is not an empty directory")
    elif dest.is_dir():
        raise InvalidArgumentError(
            f"out {dest} is a directory; format {format!r} writes one file: name the file"
        )
    parent = nearest_existing(dest.parent)
    if not parent.is_dir():
        raise InvalidArgumentError(f"out {dest}: {parent} is not a directory")


def _has_scheduler(root: Path) -> bool:
    return _first_manifest(root).get("scheduler") is not None


def _hf_config(root: Path) -> dict[str, Any]:
    entry = _first_manifest(root).get(MODEL_CONFIG_KEY)
    if not isinstance(entry, dict) or entry.get("library") != "transformers":
        raise CheckpointMismatchError(
            f"{root}: format 'hf' needs the model's transformers config, and this checkpoint "
            "records none (it was not made from a transformers model, or by a lowdiff that did "
            "not record it); export format 'safetensors' or 'torch' instead"
        )
    return entry


def _publish(dest: Path, write: Any) -> None:
    """Write through ``write(tmp_path)`` beside ``dest``, then rename it into place."""
    tmp = dest.parent / f".tmp-lowdiff-export-{uuid.uuid4().hex[:12]}-{dest.name}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(tmp)
        if dest.is_dir():
            dest.rmdir()  # empty (checked before the export started)
        os.replace(tmp, dest)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def _write_torch(
    tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sched: Any, step: int
) -> None:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": sched,
        "step": step,
    }
    # through a file object: torch names the archive inside after a path's file name,
    # which a temp name without a suffix (an --out without one) leaves empty
    with open(tmp, "wb") as f:
        torch.save(state, f)


def fqn_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter names, as ``get_optimizer_state_dict``
    returns it for a model that is not sharded (what a DCP checkpoint's users load)."""
    names = {id(p): n for n, p in model.named_parameters()}
    osd = optimizer.state_dict()
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {order[i]: dict(v) for i, v in osd["state"].items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]}
        for g in osd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _write_dcp(
    tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sched: Any, step: int
) -> None:
    import torch.distributed.checkpoint as dcp

    sd: dict[str, Any] = {
        "model": dict(model.state_dict()),
        "optimizer": fqn_optimizer_state_dict(model, optimizer),
        "step": step,
    }
    if sched is not None:
        sd["scheduler"] = sched
    tmp.mkdir()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)  # type: ignore[attr-defined]


def _write_hf(tmp: Path, model: torch.nn.Module, entry: Mapping[str, Any]) -> None:
    try:
        import transformers
    except ImportError:
        raise CheckpointMismatchError(
            "format 'hf' needs the transformers package (pip install transformers)"
        ) from None
    cls = getattr(transformers, str(entry["class"]), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointMismatchError(
            f"the recorded model class {entry['class']!r} is not a transformers model class"
        )
    config_cls: Any = cls.config_class
    if config_cls is None:
        raise CheckpointMismatchError(f"{entry['class']} names no config class")
    config = config_cls.from_dict(dict(entry["config"]))
    hf = cls(config)
    sd = model.state_dict()
    dtypes = {v.dtype for v in sd.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        hf.to(dtypes.pop())
    try:
        hf.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise RecoveryError(
            f"the recorded config of {entry['class']} does not fit the checkpoint's state: {e}"
        ) from None
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # one line per export, no bar
    try:
        hf.save_pretrained(str(tmp))
    finally:
        if bar:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    _usual_file_modes(tmp)


def _usual_file_modes(tmp: Path) -> None:
    """Give every file under ``tmp`` the mode a new file gets here (``0o666`` less the
    umask): the safetensors writer creates its files readable by their owner alone."""
    probe = tmp / f".mode-{uuid.uuid4().hex[:8]}"
    probe.touch()
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    for f in tmp.rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.chmod(mode)
