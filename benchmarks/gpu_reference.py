"""The README's GPU table in one command: lowdiff against the same training without it.

    python benchmarks/gpu_reference.py                 # the README's model on cuda:0
    python benchmarks/gpu_reference.py --model gpt2-1b --arms plain,topk,lowdiff,lowdiff+
    python benchmarks/gpu_reference.py --tiny --device cpu --repeats 1   # a smoke run

Models: causal transformer LMs built from a ``transformers`` GPT-2 config (vocabulary
16,384, 256 positions, 16 heads): ``gpt2-117m`` (8 layers, width 1024: 117.8M
parameters, the default) and ``gpt2-1b`` (20 layers, width 2048: 1.04B parameters),
built on the device from one seed. bf16 autocast, AdamW (``fused=True`` on CUDA, the
fast mode GPU users pick; the LowDiff+ replica then runs its CPU twin), gradient
clipping to norm 1 with ``ck.clip_grad_norm_`` (torch's clip, whose factor LowDiff+
hands to its replica), steps of ``--accum`` micro-batches (gradient accumulation) of
``--batch`` sequences of 255 tokens drawn from a seeded generator (nothing is
downloaded). Arms, each on its own copy of the model (``--arms``):

- ``plain``: no compression, no checkpointing;
- ``topk``: ``TopK(0.01)`` compression, no checkpointing (strategy ``"none"``);
- ``lowdiff``: the same compression, LowDiff at every step (``--full-every``,
  ``--batch-size``);
- ``lowdiff+``: no compression, LowDiff+ (``--replica-threads``; left out with
  ``--no-plus``);
- ``dcp``: no compression, ``torch.distributed.checkpoint.async_save`` of the whole
  state at every step (strategy ``"dcp-async"``, ``full_every=1``): DCP's thread saver
  with pinned-memory staging on CUDA, at most one save in flight, the mode its users
  run to checkpoint often.

Every repeat runs every arm once, in an order that rotates between repeats, after one
untimed warm-up block per arm. A block is ``--steps`` steps (``--arm-steps`` sets another
count for named arms: ``dcp=8,lowdiff+=20`` keeps the arms that write the whole state
to short blocks) and ends with ``ck.flush()``: its time counts everything until the
block's checkpoints are durable. Reported: the median time per step of each arm over the
repeats, each repeat's figure, and the ratios of ``lowdiff`` to ``topk`` and of
``lowdiff+`` and ``dcp`` to ``plain`` (compare ratios, measured side by side, not
absolute times across machines), with the GPU memory the run held at its peak and, per
arm, the milliseconds per step its blocks spent in their closing ``ck.flush()``.

Bounds, for a run that must end within a fixed time:

- ``--time-budget S``: after the first repeat, an arm's block is left out when the time
  since the run began plus that arm's last block would exceed S seconds (cheap arms
  keep their repeats when an expensive one runs out of time); ``per_repeat_ms`` then
  holds fewer figures for it, and ``repeats_done`` counts the repeats that ran a block.
- ``--json`` is written after every block as well (``"complete": false`` until the
  end), so a run stopped from outside leaves the blocks it finished.
- ``--no-restore-check``: leave out the restore of the LowDiff and LowDiff+ directories
  into fresh copies (at 1.04B parameters each reads a 12.5 GB checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import lowdiff
from lowdiff.state.capture import state_tensors

MODELS = {
    "gpt2-117m": {"n_layer": 8, "n_embd": 1024},
    "gpt2-1b": {"n_layer": 20, "n_embd": 2048},
}
ARMS = ("plain", "topk", "lowdiff", "lowdiff+", "dcp")


def build_model(
    tiny: bool, device: torch.device, seed: int = 0, model: str = "gpt2-117m"
) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if tiny:
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=32)
    else:
        cfg = GPT2Config(n_head=16, vocab_size=16384, n_positions=256, **MODELS[model])
    cfg.bos_token_id = cfg.eos_token_id = 0  # inside the vocabulary
    cfg.attn_implementation = "eager" if device.type == "cpu" else "sdpa"
    torch.manual_seed(seed)
    with device:  # initialised where it trains: the same weights for every arm
        return GPT2LMHeadModel(cfg)


def build_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (the fast mode GPU users pick)."""
    return torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda"
    )


class Arm:
    """One configuration under test: its own model, optimizer and Checkpointer."""

    def __init__(self, name: str, args: argparse.Namespace, workdir: Path) -> None:
        self.name = name
        self.device = torch.device(args.device)
        self.model = build_model(args.tiny, self.device, model=args.model)
        self.opt = build_optimizer(self.model, self.device)
        seq = 31 if args.tiny else 255
        self.batch = (2 if args.tiny else args.batch, seq)
        self.accum = args.accum
        self.vocab = self.model.config.vocab_size
        self.gen = torch.Generator(device="cpu").manual_seed(1234)
        self.amp = torch.bfloat16
        topk = lowdiff.TopK(args.ratio)
        kw: dict[str, Any]
        if name == "plain":
            kw = {"strategy": "none", "compressor": lowdiff.NoCompression()}
        elif name == "topk":
            kw = {"strategy": "none", "compressor": topk}
        elif name == "lowdiff":
            kw = {
                "strategy": "lowdiff",
                "compressor": topk,
                "full_every": args.full_every,
                "batch_size": args.batch_size,
            }
        elif name == "lowdiff+":
            kw = {
                "strategy": "lowdiff+",
                "compressor": None,
                "replica_threads": args.replica_threads,
            }
        else:
            kw = {"strategy": "dcp-async", "compressor": None, "full_every": 1}
        self.steps = args.arm_steps.get(name, args.steps)
        self.parts: dict[str, float] = {}
        self.timed_steps = 0
        self.dir = workdir / name
        self.ck = lowdiff.Checkpointer(self.model, self.opt, self.dir, **kw)
        self.ck.resume()

    def step(self) -> None:
        for _ in range(self.accum):  # micro-batches of one step (gradient accumulation)
            ids = torch.randint(0, self.vocab, self.batch, generator=self.gen).to(self.device)
            with torch.autocast(self.device.type, dtype=self.amp):
                loss = self.model(input_ids=ids, labels=ids).loss
            (loss / self.accum).backward()
        self.ck.clip_grad_norm_(1.0)  # torch's clip; LowDiff+'s replica gets its factor
        self.ck.step()
        self.opt.zero_grad(set_to_none=True)

    def block(self, steps: int, timed: bool = True) -> float:
        """Seconds per step of ``steps`` steps, until their checkpoints are durable.

        A timed block also adds the Checkpointer's own timers (seconds spent in each part
        of ``ck.step()``, in the checkpointing process's merges, ...) to :attr:`parts`,
        and ``block_flush_s``: the block's closing ``ck.flush()``."""
        before = dict(self.ck.stats)
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        t1 = time.perf_counter()
        self.ck.flush()
        t2 = time.perf_counter()
        sync(self.device)
        elapsed = time.perf_counter() - t0
        if timed:
            self.timed_steps += steps
            self.parts["block_flush_s"] = self.parts.get("block_flush_s", 0.0) + t2 - t1
            for key, value in self.ck.stats.items():
                if key.endswith("_s") and isinstance(value, float):
                    self.parts[key] = self.parts.get(key, 0.0) + value - before.get(key, 0.0)
        return elapsed / steps

    def parts_ms_per_step(self) -> dict[str, float]:
        """The timed blocks' :attr:`parts` in milliseconds per step (the non-zero ones)."""
        n = max(self.timed_steps, 1)
        return {k: v * 1e3 / n for k, v in sorted(self.parts.items()) if v > 0}

    def check_restore(self, args: argparse.Namespace) -> dict[str, Any]:
        """Restore the arm's directory into a fresh copy and compare it with the live state.

        LowDiff replays the records through the same CUDA optimizer: every tensor must be
        equal. LowDiff+'s replica steps on the CPU, whose kernels round differently from
        CUDA's: integers must be equal, floats are reported by their largest relative
        difference."""
        self.ck.flush()
        model = build_model(args.tiny, self.device, seed=1, model=args.model)
        opt = build_optimizer(model, self.device)
        step = lowdiff.restore(self.dir, model, opt)
        live, got = state_tensors(self.model, self.opt), state_tensors(model, opt)
        unequal = [k for k in live if k not in got or not torch.equal(live[k], got[k])]
        ints = [k for k in unequal if not live[k].is_floating_point()]
        rel = max(
            (
                (
                    (live[k].double() - got[k].double()).norm()
                    / live[k].double().norm().clamp_min(1e-30)
                ).item()
                for k in unequal
                if k not in ints and k in got
            ),
            default=0.0,
        )
        res = {
            "step": step,
            "live_step": self.ck.step_count,
            "tensors": len(live),
            "unequal": len(unequal),
            "unequal_integers": len(ints),
            "max_relative_difference": rel,
        }
        print(f"restore check {self.name}: {res}", flush=True)
        del model, opt
        return res


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [n for n in args.arms if not (args.no_plus and n == "lowdiff+")]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lowdiff-gpu-ref-", dir=args.workdir) as d:
        arms = [Arm(n, args, Path(d)) for n in names]
        times: dict[str, list[float]] = {n: [] for n in names}
        checks: dict[str, dict[str, Any]] = {}
        repeats_done = 0
        try:
            for arm in arms:
                arm.block(args.warmup, timed=False)
            block_s: dict[str, float] = {}  # each arm's last timed block, flush included
            for r in range(args.repeats):
                order = arms[r % len(arms) :] + arms[: r % len(arms)]
                for arm in order:
                    elapsed = time.perf_counter() - t_start
                    budget = args.time_budget
                    if r > 0 and budget is not None and elapsed + block_s[arm.name] > budget:
                        print(
                            f"repeat {r + 1}: {arm.name:9s} left out: {elapsed:.1f} s spent, "
                            f"its block takes {block_s[arm.name]:.1f} s, {budget:g} s allowed",
                            flush=True,
                        )
                        continue
                    t_block = time.perf_counter()
                    times[arm.name].append(arm.block(arm.steps))
                    block_s[arm.name] = time.perf_counter() - t_block
                    repeats_done = r + 1
                    print(
                        f"repeat {r + 1}: {arm.name:9s} {times[arm.name][-1] * 1e3:.2f} ms/step",
                        flush=True,
                    )
                    if args.json is not None:  # what a run stopped from outside leaves
                        write_json(
                            args.json, result(args, arms, times, checks, repeats_done, False)
                        )
            if not args.no_restore_check:
                checks = {a.name: a.check_restore(args) for a in arms if a.name in OURS}
            res = result(args, arms, times, checks, repeats_done, True)
        finally:
            for arm in arms:
                arm.ck.close()
    res["wall_s"] = time.perf_counter() - t_start
    return res


OURS = ("lowdiff", "lowdiff+")


def result(
    args: argparse.Namespace,
    arms: list[Arm],
    times: dict[str, list[float]],
    checks: dict[str, dict[str, Any]],
    repeats_done: int,
    complete: bool,
) -> dict[str, Any]:
    """The run's figures so far: medians over the blocks each arm has run."""
    med = {n: statistics.median(v) for n, v in times.items() if v}
    by_name = {a.name: a for a in arms}
    params = sum(p.numel() for p in arms[0].model.parameters())
    cuda = args.device.startswith("cuda")
    out: dict[str, Any] = {
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "lowdiff": lowdiff.__version__,
        "cpus": os.cpu_count(),
        "git": git_revision(),
        "parameters": params,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps_per_block": {a.name: a.steps for a in arms},
        "repeats_done": repeats_done,
        "complete": complete,
        "ms_per_step": {n: v * 1e3 for n, v in med.items()},
        "per_repeat_ms": {n: [x * 1e3 for x in v] for n, v in times.items()},
        "restore_check": checks,
        "slots_pinned": {a.name: a.ck.stats["slots_pinned"] for a in arms if a.name in OURS},
        "parts_ms_per_step": {a.name: a.parts_ms_per_step() for a in arms if a.name != "plain"},
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else 0,
    }
    for key, arm, base in RATIOS:
        if arm in med and base in med:
            out[key] = med[arm] / med[base] - 1
    if "lowdiff" in by_name:
        out["record_bytes_per_step"] = by_name["lowdiff"].ck.stats["record_row_bytes"]
    return out


def write_json(path: Path, res: dict[str, Any]) -> None:
    """Write ``res`` to ``path`` whole or not at all (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=2))
    tmp.replace(path)


RATIOS = (
    ("lowdiff_vs_topk", "lowdiff", "topk"),
    ("lowdiff_plus_vs_plain", "lowdiff+", "plain"),
    ("dcp_vs_plain", "dcp", "plain"),
)
RATIO_LINES = {
    "lowdiff_vs_topk": "LowDiff against the same compressed training",
    "lowdiff_plus_vs_plain": "LowDiff+ against the same uncompressed training",
    "dcp_vs_plain": "DCP async_save every step against the same uncompressed training",
}


def arm_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ARMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown arm(s) {', '.join(bad) or '(none)'}; choose from {', '.join(ARMS)}"
        )
    return list(dict.fromkeys(names))


def arm_steps(text: str) -> dict[str, int]:
    """``NAME=N,...``: timed steps per block for the named arms."""
    out: dict[str, int] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, _, n = item.partition("=")
        name = name.strip()
        if name not in ARMS or not n.strip().isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(
                f"expected NAME=STEPS with NAME from {', '.join(ARMS)} and STEPS >= 1, got {item!r}"
            )
        out[name] = int(n)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (a smoke run)")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2-117m")
    ap.add_argument("--batch", type=int, default=16, help="sequences of 255 tokens per step")
    ap.add_argument(
        "--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)"
    )
    ap.add_argument(
        "--arms",
        type=arm_list,
        default=list(ARMS[:4]),
        help=f"comma-separated, from {','.join(ARMS)} (default: the first four)",
    )
    ap.add_argument("--replica-threads", type=int, default=1, help="LowDiff+ replica_threads")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per block")
    ap.add_argument(
        "--arm-steps",
        type=arm_steps,
        default={},
        help="timed steps per block for named arms, e.g. dcp=8,lowdiff+=20 (default: --steps)",
    )
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps per arm first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="S",
        help="after the first repeat, leave out an arm's block when the run's time plus "
        "that arm's last block would exceed S seconds",
    )
    ap.add_argument(
        "--no-restore-check",
        action="store_true",
        help="leave out the restore of the LowDiff and LowDiff+ directories",
    )
    ap.add_argument("--ratio", type=float, default=0.01, help="TopK ratio")
    ap.add_argument("--full-every", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=5)
    ap.add_argument("--no-plus", action="store_true", help="leave LowDiff+ out")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = run(args)
    print(
        f"\n{res['device']}, torch {res['torch']}, git {res['git']}, "
        f"{res['parameters'] / 1e6:.1f}M parameters, batch {2 if args.tiny else args.batch}"
        f" x {args.accum} micro-batches"
    )
    print(
        f"{res['repeats_done']} of {args.repeats} repeat(s) in {res['wall_s']:.0f} s; "
        "steps per block: " + ", ".join(f"{k} {v}" for k, v in res["steps_per_block"].items())
    )
    for n, v in res["ms_per_step"].items():
        reps = ", ".join(f"{x:.2f}" for x in res["per_repeat_ms"][n])
        flush = res["parts_ms_per_step"].get(n, {}).get("block_flush_s", 0.0)
        print(f"{n:9s} {v:8.2f} ms per step (median; per repeat {reps}; closing flush {flush:.2f})")
    for key, text in RATIO_LINES.items():
        if key in res:
            print(f"{text}: {res[key]:+.1%}")
    if "record_bytes_per_step" in res:
        print(f"record: {res['record_bytes_per_step'] / 1e6:.2f} MB per step")
    for name, parts in res["parts_ms_per_step"].items():
        if parts:
            print(
                f"{name} timers, ms per step: "
                + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
            )
    for name, flag in res["slots_pinned"].items():
        print(f"{name}: slots page-locked: {'yes' if flag else 'no'}")
    if args.no_restore_check:
        print("restore check: left out (--no-restore-check)")
    for name, chk in res["restore_check"].items():
        print(
            f"restore of {name} at step {chk['step']} (live {chk['live_step']}): "
            f"{chk['unequal']} of {chk['tensors']} tensors differ "
            f"({chk['unequal_integers']} integer; largest relative difference "
            f"{chk['max_relative_difference']:.1e})"
        )
    if res["gpu_total_bytes"]:
        print(
            f"GPU memory at its peak: {res['gpu_peak_bytes'] / 2**30:.1f} of "
            f"{res['gpu_total_bytes'] / 2**30:.1f} GiB"
        )
    if args.json is not None:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
