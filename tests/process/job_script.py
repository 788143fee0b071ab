"""A real training job for the multi-process tests (run as a script, killed with SIGKILL).

Usage: python job_script.py CONFIG_JSON
Prints one line per finished step: ``step <n> <loss.hex()>`` (n = updates done so far).
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time

import numpy as np
import safetensors.torch
import torch

import lowdiff
from lowdiff.state.capture import state_tensors


def build(seed: int = 0):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.GELU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 8),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _count_file_reads() -> list[int]:
    """Count every read of a checkpoint file (data or header) from now on."""
    from lowdiff.format import sfile

    count = [0]
    for name in ("read_raw", "read_header"):
        orig = getattr(sfile, name)

        def wrapped(*a, _orig=orig, **k):
            count[0] += 1
            return _orig(*a, **k)

        setattr(sfile, name, wrapped)
    return count


def dump(path: str, model, opt, sched) -> None:
    safetensors.torch.save_file(
        {
            k: v.detach().cpu().contiguous().clone()
            for k, v in state_tensors(model, opt, sched).items()
        },
        path,
    )


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    if "own_sigterm_exit" in cfg:  # the job's own SIGTERM handler, set before lowdiff's

        def on_sigterm(signum, frame) -> None:
            print(f"own handler {signum} {frame is not None}", flush=True)
            sys.exit(cfg["own_sigterm_exit"])

        signal.signal(signal.SIGTERM, on_sigterm)
    device = torch.device(cfg.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.manual_seed_all(0)
    model, opt, sched = build()
    model.to(device)
    extra: dict = {}
    if cfg["strategy"] == "lowdiff+":
        comp = None
        extra = {
            "max_lag": cfg.get("max_lag", 2),
            "persist_every": cfg.get("persist_every", "auto"),
            "idle_timeout": cfg.get("idle_timeout", 60.0),
        }
    elif cfg.get("uncompressed"):
        comp = lowdiff.NoCompression()
    else:
        comp = lowdiff.TopK(
            ratio=cfg.get("ratio", 0.05), error_feedback=cfg.get("error_feedback", False)
        )
    if cfg["strategy"] in ("lowdiff", "gemini"):
        extra["idle_timeout"] = cfg.get("idle_timeout", 60.0)
    if cfg["strategy"] in ("lowdiff", "lowdiff+"):
        extra["batch_size"] = cfg.get("batch_size", 3)
    if "sigterm_timeout" in cfg:
        extra["sigterm_timeout"] = cfg["sigterm_timeout"]
    make = lowdiff.attach if cfg.get("attach") else lowdiff.Checkpointer
    ck = make(
        model,
        opt,
        cfg["dir"],
        strategy=cfg["strategy"],
        compressor=comp,
        scheduler=sched,
        full_every=cfg.get("full_every", 10),
        keep_full=cfg.get("keep_full", 2),
        **extra,
    )
    reads = _count_file_reads()
    start = ck.resume()
    rs = ck.recovery_stats
    print(f"resumed {start}", flush=True)
    print(f"recovery {rs.source if rs else 'none'} {reads[0]}", flush=True)
    proc = getattr(ck.strategy_impl, "worker_process", None)
    adopted = rs.takeover_pid if rs else None
    print(f"process {proc.pid if proc else -1} adopted {adopted or -1}", flush=True)
    if cfg.get("dump_at_resume"):
        dump(cfg["dump_at_resume"], model, opt, sched)
    dumps = {int(k): v for k, v in cfg.get("dump_at", {}).items()}
    staging_told = not cfg.get("report_staging")
    for step in range(start, cfg["steps"]):
        if step in dumps:
            dump(dumps[step], model, opt, sched)
        x, y = (t.to(device) for t in batch(step))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if cfg.get("attach"):  # the user's own loop: lowdiff runs inside opt.step()
            opt.step()
            sched.step()
        else:
            ck.step()
        opt.zero_grad()
        impl = ck.strategy_impl
        if not staging_told and impl.stager.staged:
            # the first full checkpoint since resume(): whose staging buffer it went into
            given = impl.session.staging
            buffer = impl.stager.buffer
            same = given is not None and buffer.data_ptr() == given.data_ptr()
            print(f"staged {step + 1} into {'the process' if same else 'own'} buffer", flush=True)
            staging_told = True
        durable = f" {ck.durable_step}" if cfg.get("print_durable") else ""
        print(f"step {step + 1} {loss.item().hex()}{durable}", flush=True)
        if cfg.get("sleep"):
            time.sleep(cfg["sleep"])
    if cfg["steps"] in dumps:
        dump(dumps[cfg["steps"]], model, opt, sched)
    ck.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
