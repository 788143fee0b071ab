"""A real training job: GPT-2-style byte LM on the standard-library corpus, checkpointed.

Run it as ``python -m lowdiff_lab.workloads.train --config CONFIG.json``. It resumes from the
checkpoint directory if there is anything to resume, trains to ``steps``, and reports on
stdout as JSON lines (one object per line, flushed, so a parent can follow and kill it):

- ``{"event": "start", "pid": ..., "n_params": ..., ...}`` once the model is built;
- ``{"event": "resumed", "step": s, "recovered": bool, "recovery": {...} | null}`` after
  ``resume()`` (``recovery`` holds the recovery stats: read/decode/replay seconds, ...);
- ``{"event": "step", "step": s, "loss": ..., "t": ..., "dt": ..., "durable": ...}`` per step;
- ``{"event": "done", ...}`` at the end, after the result JSON is written.

Step numbers count completed optimizer steps, the convention of
:meth:`lowdiff.Checkpointer.resume`: the step event with ``"step": s`` is sent once the
state "after ``s`` steps" exists, and a run resumed at ``s`` trains step indices ``s..``.

Config keys (JSON object; unknown keys are rejected to catch typos):
    model, seed, data_seed, steps, batch_size, seq_len, lr, weight_decay, warmup_steps,
    min_lr_ratio, strategy, directory, compressor, full_every, batch_size_records,
    keep_full, threads, eval_batches, dump_state_at_resume, dump_state_at_step,
    result_path, strategy_options. See :class:`TrainConfig`.

Strategies: ``"lowdiff"``, ``"lowdiff+"``, ``"none"`` and the baselines of
:data:`lowdiff_lab.baselines.BASELINES` (``"torch-save"``, ``"checkfreq"``, ``"gemini"``,
``"naive-dc"``, ``"dcp-async"``), all through ``lowdiff.Checkpointer(..., method=...)``.
A baseline trains with ``compressor`` as the ``"none"`` strategy does (``{"kind": "none"}``:
uncompressed) and takes no ``batch_size_records``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from lowdiff.checkpointer import Checkpointer
from lowdiff.compressors import compressor_from_spec
from lowdiff.inspection import inspect_dir
from lowdiff.methods import method_modules
from lowdiff.recovery.restore import recover
from lowdiff.state.capture import state_tensors
from lowdiff_lab import checkpointers
from lowdiff_lab.baselines import BASELINES
from lowdiff_lab.workloads import models, text

PRELOAD = (
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    *method_modules(),  # lowdiff's own and the baselines', the same for every method
    "lowdiff_lab.workloads.train",
)
"""What a fork server of this job imports (see :mod:`lowdiff_lab.prefork`): everything the
job imports before its first step, so a forked child starts at the model build. (Not
the corpus: building it runs torch operations, and GNU OpenMP's threads, once started,
do not survive a fork.)"""


@dataclass
class TrainConfig:
    """Everything that defines one training job.

    Attributes:
        directory: Checkpoint directory handed to the Checkpointer.
        model: Named model (see :data:`lowdiff_lab.workloads.models.MODELS`).
        seed: Seeds model initialisation (and therefore the dropout stream) and the
            Python and NumPy global RNGs.
        data_seed: Seeds the batch order; ``None`` means ``seed``.
        steps: Total optimizer steps of the job (a resumed job trains the rest).
        batch_size: Training sequences per step.
        seq_len: Tokens per sequence.
        lr: Peak learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up length; ``None`` means 10% of ``steps``.
        min_lr_ratio: Cosine floor as a fraction of ``lr``.
        strategy: Checkpointer strategy (``"lowdiff"``, ``"lowdiff+"``, ``"none"`` or a
            baseline's name, e.g. ``"checkfreq"``).
        compressor: Compressor spec, e.g. ``{"kind": "topk", "ratio": 0.01}``.
        full_every: Steps between full checkpoints (``"auto"`` where the strategy takes it).
        batch_size_records: Records per write batch (the Checkpointer's ``batch_size``;
            LowDiff's strategies only).
        keep_full: Full checkpoints to keep.
        threads: Intra-op torch threads; ``None`` means ``os.cpu_count()``.
        eval_batches: Held-out batches for the final evaluation.
        dump_state_at_resume: Dump ``state_tensors`` here right after ``resume()``.
        dump_state_at_step: ``{"step": s, "path": p}``: dump the state after ``s`` steps.
        result_path: Write the result JSON here at the end.
        strategy_options: Further keyword arguments of the Checkpointer (e.g.
            ``{"persist_every": 10}`` for ``"gemini"``).
    """

    directory: str
    model: str = "gpt2-demo"
    seed: int = 0
    data_seed: int | None = None
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    strategy: str = "lowdiff"
    compressor: dict[str, Any] = field(default_factory=lambda: {"kind": "topk", "ratio": 0.01})
    full_every: int | str = 30
    batch_size_records: int | str = 3
    keep_full: int | None = 2
    threads: int | None = None
    eval_batches: int = 8
    dump_state_at_resume: str | None = None
    dump_state_at_step: dict[str, Any] | None = None
    result_path: str | None = None
    strategy_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build a config from a JSON object, rejecting unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training config keys: {unknown}")
        cfg = cls(**data)
        if cfg.steps < 0:
            raise ValueError(f"steps must be >= 0, got {cfg.steps}")
        if cfg.model not in models.MODELS:
            raise ValueError(f"unknown model {cfg.model!r}; known: {sorted(models.MODELS)}")
        if not 0 < cfg.seq_len <= models.MODELS[cfg.model].n_positions:
            raise ValueError(
                f"seq_len must be in 1..{models.MODELS[cfg.model].n_positions}, got {cfg.seq_len}"
            )
        if not isinstance(cfg.strategy_options, dict):
            raise ValueError(
                f"strategy_options must be a JSON object, got {cfg.strategy_options!r}"
            )
        dsa = cfg.dump_state_at_step
        if dsa is not None and (not isinstance(dsa, dict) or set(dsa) != {"step", "path"}):
            raise ValueError(
                f'dump_state_at_step must be {{"step": int, "path": str}}, got {dsa!r}'
            )
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """Read a config JSON file."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def emit(event: str, **payload: Any) -> None:
    """Print one JSON event line to stdout and flush it (the parent follows it live)."""
    sys.stdout.write(json.dumps({"event": event, **payload}) + "\n")
    sys.stdout.flush()


def dump_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    path: str | Path,
) -> int:
    """Save the whole training state as a safetensors file for exact comparison.

    Returns:
        The number of tensors written.
    """
    tensors = state_tensors(model, optimizer, scheduler)
    # clone(): safetensors refuses tensors that share storage, and a dump must not alias
    # live training state anyway.
    out = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path))
    return len(out)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> Any:
    """Linear warm-up then cosine decay to ``min_lr_ratio * lr``."""
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 10)
    warmup = max(1, warmup)
    decay = max(1, cfg.steps - warmup)
    return SequentialLR(
        optimizer,
        [
            LinearLR(optimizer, start_factor=0.1, end_factor=1.0, total_iters=warmup),
            CosineAnnealingLR(optimizer, T_max=decay, eta_min=cfg.lr * cfg.min_lr_ratio),
        ],
        milestones=[warmup],
    )


def _recovery_dict(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    names = (
        "source",
        "files_read",
        "read_s",
        "decode_s",
        "replay_s",
        "total_s",
        "full_step",
        "step",
        "records_replayed",
        "bytes_read",
    )
    return {n: getattr(stats, n, None) for n in names}


@torch.no_grad()
def evaluate(model: torch.nn.Module, cfg: TrainConfig) -> float:
    """Mean held-out loss over ``cfg.eval_batches`` fixed batches (no RNG drawn)."""
    was_training = model.training
    model.eval()
    try:
        batches = text.eval_batches(cfg.eval_batches, cfg.batch_size, cfg.seq_len)
        losses = [float(models.lm_loss(model, x, y)) for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def build_training_objects(cfg: TrainConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The job's model, optimizer and LR scheduler, built exactly as training builds them."""
    model = models.build_model(cfg.model, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return model, optimizer, build_scheduler(optimizer, cfg)


def probe_recovery(cfg: TrainConfig, directory: str | Path) -> dict[str, Any] | None:
    """Time a recovery with the most records to replay that ``directory`` allows.

    That is the step just before a full checkpoint, replayed from the one before it
    (``full_every - 1`` records), which bounds the recovery time of any failure.
    """
    info = inspect_dir(directory)
    if not info.full_checkpoints or info.recoverable is None:
        return None
    fulls = [f.first_step for f in info.full_checkpoints]
    if cfg.strategy == "lowdiff+":
        target = fulls[-1]  # LowDiff+ persists whole replicas: a disk recovery loads one
    else:
        base = fulls[-2] if len(fulls) >= 2 else fulls[-1]
        target = min(base + int(cfg.full_every) - 1, info.recoverable[1])
    model, optimizer, scheduler = build_training_objects(cfg)
    stats = recover(directory, model, optimizer, scheduler, step=target)
    return _recovery_dict(stats)


@dataclass
class _Progress:
    """What the training loop of :func:`train` reports back (times from ``perf_counter``)."""

    start: int
    """The step ``resume()`` returned."""
    recovery: dict[str, Any] | None
    """The recovery stats of the resume (see :func:`_recovery_dict`)."""
    t_loop: float
    """When the loop began."""
    train_s: float
    """Seconds spent in the loop, state dumps excluded."""
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)


def _seed_globals(cfg: TrainConfig) -> int:
    """Set torch's thread count and seed the Python and NumPy global RNGs; returns the
    thread count."""
    threads = cfg.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    # Python's and NumPy's global RNGs are checkpointed state too; unseeded they would
    # start from OS entropy, and no two runs could ever be compared bit for bit.
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % (1 << 32))
    return threads


def build_checkpointer(
    cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> Checkpointer:
    """The job's Checkpointer: ``cfg.strategy`` with its compressor and options."""
    options: dict[str, Any] = dict(cfg.strategy_options)
    if cfg.strategy in BASELINES:
        # a baseline trains compressed (or not) as strategy "none" does; it has no batches
        uncompressed = cfg.compressor.get("kind") == "none"
    else:
        uncompressed = cfg.strategy == "lowdiff+"
        options["batch_size"] = cfg.batch_size_records
    return checkpointers.build(
        cfg.directory,
        model,
        optimizer,
        cfg.strategy,
        compressor=None if uncompressed else compressor_from_spec(cfg.compressor),
        full_every=cfg.full_every,
        scheduler=scheduler,
        keep_full=cfg.keep_full,
        **options,
    )


def _resume_and_train(
    cfg: TrainConfig,
    ck: Checkpointer,
    objects: tuple[torch.nn.Module, torch.optim.Optimizer, Any],
    corpus: text.Corpus,
    data_seed: int,
) -> _Progress:
    """Resume, then train steps ``start .. cfg.steps - 1``, emitting an event per step."""
    model, optimizer, scheduler = objects
    start = ck.resume()
    recovery = _recovery_dict(ck.recovery_stats)
    if cfg.dump_state_at_resume:
        dump_state(model, optimizer, scheduler, cfg.dump_state_at_resume)
    emit("resumed", step=start, recovered=recovery is not None, recovery=recovery)
    dump_at = cfg.dump_state_at_step
    run = _Progress(start=start, recovery=recovery, t_loop=time.perf_counter(), train_s=0.0)
    dump_s = 0.0
    for step in range(start, cfg.steps):
        if dump_at is not None and step == dump_at["step"]:
            t0 = time.perf_counter()
            dump_state(model, optimizer, scheduler, dump_at["path"])
            dump_s += time.perf_counter() - t0
        inputs, targets = text.batch_for(step, cfg.batch_size, cfg.seq_len, data_seed, corpus)
        t0 = time.perf_counter()
        loss = models.lm_loss(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ck.step()
        optimizer.zero_grad()
        dt = time.perf_counter() - t0
        loss_value = float(loss.detach())
        run.step_times.append(dt)
        run.losses.append(loss_value)
        emit("step", step=step + 1, loss=loss_value, t=time.time(), dt=dt, durable=ck.durable_step)
    if dump_at is not None and dump_at["step"] == cfg.steps and start <= cfg.steps:
        dump_state(model, optimizer, scheduler, dump_at["path"])
    run.train_s = time.perf_counter() - run.t_loop - dump_s
    return run


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) the job described by ``cfg`` and return its result dict."""
    t_start = time.perf_counter()
    threads = _seed_globals(cfg)
    data_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    corpus = text.load_corpus()
    model, optimizer, scheduler = build_training_objects(cfg)
    n_params = models.count_parameters(model)
    ck = build_checkpointer(cfg, model, optimizer, scheduler)
    emit(
        "start",
        pid=os.getpid(),
        model=cfg.model,
        n_params=n_params,
        threads=threads,
        strategy=cfg.strategy,
        steps=cfg.steps,
    )
    try:
        run = _resume_and_train(cfg, ck, (model, optimizer, scheduler), corpus, data_seed)
        t0 = time.perf_counter()
        ck.close()
        close_s = time.perf_counter() - t0
    except BaseException:
        # Leave the background process no chance to linger; the original error matters more
        # than a secondary one from close().
        with contextlib.suppress(Exception):
            ck.close()
        raise
    eval_loss = evaluate(model, cfg)
    tail = run.losses[-10:]
    return {
        "model": cfg.model,
        "n_params": n_params,
        "strategy": cfg.strategy,
        "compressor": cfg.compressor,
        "steps": cfg.steps,
        "start_step": run.start,
        "final_loss": run.losses[-1] if run.losses else None,
        "final_loss_mean10": sum(tail) / len(tail) if tail else None,
        "eval_loss": eval_loss,
        "losses": run.losses,
        "step_times": run.step_times,
        "train_s": run.train_s,
        "close_s": close_s,
        "startup_s": run.t_loop - t_start,
        "durable_step": ck.durable_step,
        "ck_stats": ck.stats,
        "recovery": run.recovery,
        "threads": threads,
        "torch_version": torch.__version__,
        "config": asdict(cfg),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python -m lowdiff_lab.workloads.train --config CONFIG.json``."""
    parser = argparse.ArgumentParser(
        prog="python -m lowdiff_lab.workloads.train", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", required=True, help="training config JSON file")
    parser.add_argument(
        "--probe-recovery",
        metavar="DIR",
        default=None,
        help="train nothing: time the longest recovery DIR allows (probe_recovery) in this "
        "new process, as a restarted trainer's would be, and print it as a 'probe' event",
    )
    args = parser.parse_args(argv)
    cfg = TrainConfig.load(args.config)
    if args.probe_recovery is not None:
        _seed_globals(cfg)
        emit("probe", recovery=probe_recovery(cfg, args.probe_recovery))
        return 0
    result = train(cfg)
    if cfg.result_path:
        path = Path(cfg.result_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
    summary = {
        k: result[k] for k in ("start_step", "final_loss", "eval_loss", "train_s", "close_s")
    }
    emit("done", step=cfg.steps, **summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
