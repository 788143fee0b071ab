"""One Markdown table of what ``benchmarks/gpu_check.sh`` measured, from the files in its $OUT.

    python benchmarks/gpu_summary.py /tmp/gpu-check            # print the table
    python benchmarks/gpu_summary.py --write-env env.json      # describe this machine

Reads whatever the phases left in the folder and shows a phase that left nothing as
"not run", so it works on any subset of the phases:

- ``env.json`` (``--write-env``): the GPU, torch, CUDA, lowdiff, the host's cores and
  the device-to-host copy bandwidth of ``benchmarks/gpu_copy_check.py``: the header line;
- every other ``*.json`` with ``ms_per_step`` (``benchmarks/gpu_reference.py --json``):
  one row per model size and arm, with its overhead against its baseline measured in the
  same run (LowDiff against TopK; LowDiff+ and DCP against plain) and the targets:
  LowDiff at most +5% over TopK; LowDiff+ at most +10% where the bare CPU AdamW step
  (the ``replica`` phase, at the arm's thread count; measured at 117.8M parameters and
  scaled by the parameter count for another size, marked ≈) is at most half a plain
  training step;
  each costing less per step than DCP ``async_save`` every step (the time a step adds
  to its baseline, each from its own run);
- a ``*.json`` of replica rows (``lowdiff_lab.bench.replica.replica_update_bench``): one
  row per thread count, the replica's update against a bare fused CPU AdamW step
  (target :data:`REPLICA_TARGET`);
- ``tests.log`` (``pytest -v -m gpu``): how many CUDA tests passed and failed;
- ``recovery.jsonl`` (``lowdiff bench``'s ``results.jsonl``): each method's time to the
  first new step after a failure, against torch.save's.

Example:
    >>> print(summary(load(Path("/tmp/gpu-check"))))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARMS = ("plain", "topk", "lowdiff", "lowdiff+", "dcp")
"""The arms of ``gpu_reference.py``, in the table's order."""
ARM_NAMES = {
    "plain": "plain",
    "topk": "TopK",
    "lowdiff": "LowDiff",
    "lowdiff+": "LowDiff+",
    "dcp": "DCP async_save",
}
BASELINE = {"lowdiff": "topk", "lowdiff+": "plain", "dcp": "plain"}
"""Each checkpointing arm's baseline: the same training without checkpoints."""
SIZES = {"gpt2-117m": ("117.8M", "ref117m"), "gpt2-1b": ("1.04B", "ref1b")}
"""The model sizes gpu_check.sh measures: their label and the phase that measures them."""
LOWDIFF_TARGET = 0.05
"""LowDiff's overhead over TopK training, at most."""
LOWDIFF_PLUS_TARGET = 0.10
"""LowDiff+'s overhead over plain training, at most, where it applies (see below)."""
LOWDIFF_PLUS_APPLIES = 0.5
"""LowDiff+'s target applies where the bare CPU AdamW step is at most this fraction of a
training step (the replica's update has to fit beside the step)."""
REPLICA_TARGET = 1.3
"""The replica's update against a bare fused CPU AdamW step, at most (on a GPU host)."""
COLUMNS = ("check", "measured", "blocks", "baseline (same run)", "overhead", "target", "met")


@dataclass
class Results:
    """What the phases left in one folder."""

    env: dict[str, Any] | None = None
    references: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """(file name, ``gpu_reference.py`` result), by file name."""
    replica: list[dict[str, Any]] | None = None
    tests: dict[str, Any] | None = None
    recovery: list[dict[str, Any]] | None = None


# --------------------------------------------------------------------------- reading


def load(out: Path) -> Results:
    """Read every file the phases write into ``out`` (a file that cannot be read is
    named on stderr and left out)."""
    res = Results()
    for path in sorted(out.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"gpu_summary: {path.name} left out: {e}", file=sys.stderr)
            continue
        if isinstance(data, dict) and data.get("kind") == "gpu-env":
            res.env = data
        elif isinstance(data, dict) and "ms_per_step" in data:
            res.references.append((path.name, data))
        elif (rows := replica_rows(data)) is not None:
            res.replica = (res.replica or []) + rows
    tests = out / "tests.log"
    if tests.exists():
        res.tests = parse_pytest(tests.read_text(errors="replace"))
    recovery = out / "recovery.jsonl"
    if recovery.exists():
        rows = []
        for line in recovery.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("kind") == "row" and row.get("experiment") == "recovery":
                rows.append(row)
        res.recovery = rows
    return res


def replica_rows(data: Any) -> list[dict[str, Any]] | None:
    """The rows of ``replica_update_bench``, alone or under ``"rows"``; None otherwise."""
    rows = data.get("rows") if isinstance(data, dict) else data
    if isinstance(rows, list) and all(isinstance(r, dict) and "replica_s" in r for r in rows):
        return rows
    return None


_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def parse_pytest(text: str) -> dict[str, Any]:
    """Counts of a pytest log: from its closing line when there is one (``complete``),
    else from the per-test lines of ``-v`` (a run stopped from outside), and the tests
    that failed or errored."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    lines = text.splitlines()
    closing = [
        ln
        for ln in lines
        if re.search(r"\bin \d+(\.\d+)?s\b", ln) and (_COUNT.search(ln) or "no tests ran" in ln)
    ]
    failures: list[str] = []
    if closing:
        for n, word in _COUNT.findall(closing[-1]):
            key = "errors" if word.startswith("error") else word
            if key in counts:
                counts[key] += int(n)
        failures = [ln.split()[1] for ln in lines if re.match(r"^(FAILED|ERROR) \S", ln)]
    else:
        word_key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors"}
        for ln in lines:
            m = _VERBOSE.match(ln)
            if m:
                counts[word_key.get(m.group(2), "skipped")] += 1
                if m.group(2) in ("FAILED", "ERROR"):
                    failures.append(m.group(1))
    return {**counts, "complete": bool(closing), "failures": list(dict.fromkeys(failures))}


# --------------------------------------------------------------------------- the table


def fmt_ms(ms: float) -> str:
    """Milliseconds with about four significant figures."""
    if ms >= 1000:
        return f"{ms:,.0f} ms"
    return f"{ms:.1f} ms" if ms >= 100 else f"{ms:.2f} ms"


def fmt_s(s: float) -> str:
    """Seconds, in milliseconds below one."""
    return fmt_ms(s * 1e3) if s < 1 else f"{s:.2f} s"


def fmt_pct(x: float) -> str:
    """A ratio minus one as a signed percentage."""
    return f"{x:+.1%}"


def yes_no(ok: bool) -> str:
    """A target met or not (a miss in bold)."""
    return "yes" if ok else "**no**"


def size_of(run: dict[str, Any]) -> str:
    """The model of a ``gpu_reference.py`` run (``tiny`` for its smoke model)."""
    s = run.get("settings", {})
    return "tiny" if s.get("tiny") else str(s.get("model", "gpt2-117m"))


def size_label(size: str, runs: list[dict[str, Any]]) -> str:
    """The model size as the table names it."""
    if size in SIZES:
        return SIZES[size][0]
    params = runs[0].get("parameters", 0) if runs else 0
    return f"{size} ({params / 1e6:.1f}M)"


def added_ms(run: dict[str, Any], arm: str) -> float | None:
    """The time per step ``arm`` adds to its baseline in ``run``, if both ran."""
    ms = run.get("ms_per_step", {})
    base = BASELINE.get(arm)
    if arm in ms and base in ms:
        return float(ms[arm]) - float(ms[base])
    return None


def bare_adamw_ms(
    replica: list[dict[str, Any]] | None, threads: int, params: int
) -> tuple[float, bool] | None:
    """The bare CPU AdamW step at ``threads`` threads (the row with the nearest count),
    scaled to ``params`` parameters when the rows measured another size; (ms, scaled)."""
    if not replica:
        return None
    row = min(
        replica, key=lambda r: (abs(int(r.get("threads", 0)) - threads), -int(r.get("threads", 0)))
    )
    ms = float(row["bare_s"]) * 1e3
    n = int(row.get("n_params") or 0)
    if n and params and abs(params / n - 1) > 0.05:
        return ms * params / n, True
    return ms, False


def reference_rows(res: Results) -> list[list[str]]:
    """The rows of every model size: one per arm, then LowDiff's and LowDiff+'s cost
    against DCP's."""
    by_size: dict[str, list[dict[str, Any]]] = {}
    for _, run in res.references:
        by_size.setdefault(size_of(run), []).append(run)
    rows: list[list[str]] = []
    for size in [*SIZES, *(s for s in by_size if s not in SIZES)]:
        runs = by_size.get(size, [])
        label = size_label(size, runs)
        if not runs:
            phase = SIZES[size][1]
            rows.append([f"{label}: all arms", f"not run ({phase})", "", "", "", "", ""])
            continue
        # the run of each arm: the one with the most arms that measured it
        runs = sorted(runs, key=lambda r: -len(r.get("ms_per_step", {})))
        of_arm = {a: next((r for r in runs if a in r.get("ms_per_step", {})), None) for a in ARMS}
        planned = {a for r in runs for a in r.get("settings", {}).get("arms", [])}
        for arm in ARMS:
            rows.append(arm_row(label, arm, of_arm[arm], res.replica, arm in planned))
        dcp_run = of_arm["dcp"]
        dcp_cost = added_ms(dcp_run, "dcp") if dcp_run else None
        for arm in ("lowdiff", "lowdiff+"):
            arm_run = of_arm[arm]
            cost = added_ms(arm_run, arm) if arm_run else None
            check = f"{label} {ARM_NAMES[arm]} cheaper than DCP"
            target = "adds less per step than DCP"
            if cost is None or dcp_cost is None:
                missing = "DCP" if dcp_cost is None else ARM_NAMES[arm]
                rows.append([check, f"not run ({missing})", "", "", "", target, ""])
                continue
            rows.append(
                [
                    check,
                    f"adds {fmt_ms(cost)} a step; DCP adds {fmt_ms(dcp_cost)}",
                    "",
                    "",
                    "",
                    target,
                    yes_no(cost < dcp_cost),
                ]
            )
    return rows


def arm_row(
    label: str,
    arm: str,
    run: dict[str, Any] | None,
    replica: list[dict[str, Any]] | None,
    planned: bool = False,
) -> list[str]:
    """One arm's row: its time per step, its blocks, its overhead and target."""
    check = f"{label} {ARM_NAMES[arm]}"
    if run is None:
        text = "no timed block (run cut short)" if planned else "not run"
        return [check, text, "", "", "", target_text(arm), ""]
    ms = float(run["ms_per_step"][arm])
    flush = run.get("parts_ms_per_step", {}).get(arm, {}).get("block_flush_s", 0.0)
    measured = fmt_ms(ms) + (f" ({fmt_ms(flush)} in flush)" if flush >= 0.005 else "")
    steps = run.get("steps_per_block", {}).get(arm, run.get("settings", {}).get("steps", "?"))
    blocks = f"{steps} steps × {len(run.get('per_repeat_ms', {}).get(arm, []))}"
    if run.get("complete") is False:
        blocks += " (run cut short)"
    base = BASELINE.get(arm)
    if base is None:
        return [check, measured, blocks, "", "", "", ""]
    base_ms = run["ms_per_step"].get(base)
    if base_ms is None:
        return [check, measured, blocks, f"{base}: not run", "", target_text(arm), ""]
    over = ms / float(base_ms) - 1
    baseline = f"{ARM_NAMES[base]} {fmt_ms(float(base_ms))}"
    row = [check, measured, blocks, baseline, fmt_pct(over)]
    if arm == "lowdiff":
        return [*row, target_text(arm), yes_no(over <= LOWDIFF_TARGET)]
    if arm == "lowdiff+":
        threads = int(run.get("settings", {}).get("replica_threads", 1))
        bare = bare_adamw_ms(replica, threads, int(run.get("parameters", 0)))
        half = float(base_ms) * LOWDIFF_PLUS_APPLIES
        if bare is None:
            return [*row, target_text(arm) + " (replica not run)", "?"]
        bare_ms, scaled = bare
        bare_s = ("≈ " if scaled else "") + fmt_ms(bare_ms)
        if bare_ms <= half:
            why = f"; applies: bare {bare_s} ≤ {fmt_ms(half)}"
            return [*row, target_text(arm) + why, yes_no(over <= LOWDIFF_PLUS_TARGET)]
        why = f"; does not apply: bare {bare_s} > {fmt_ms(half)}"
        return [*row, target_text(arm) + why, "n/a"]
    return [*row, "", ""]


def target_text(arm: str) -> str:
    """The arm's target, as the table states it."""
    if arm == "lowdiff":
        return f"≤ {LOWDIFF_TARGET:+.0%}"
    if arm == "lowdiff+":
        return f"≤ {LOWDIFF_PLUS_TARGET:+.0%} where bare CPU AdamW ≤ ½ step"
    return ""


def replica_table_rows(res: Results) -> list[list[str]]:
    """One row per thread count of the replica phase."""
    target = f"≤ {REPLICA_TARGET:.1f}x"
    if res.replica is None:
        return [["replica update", "not run (replica)", "", "", "", target, ""]]
    rows = []
    for r in sorted(res.replica, key=lambda r: int(r["threads"])):
        bits = "same bits" if r.get("identical", True) else "bits differ"
        name = str(r.get("optimizer", "AdamW")).rsplit(".", 1)[-1]
        flags = [k for k, v in r.get("flags", {}).items() if v is True]
        kernel = " ".join([*flags, name])
        rows.append(
            [
                f"replica update, {r['threads']} thread{'' if r['threads'] == 1 else 's'}, "
                f"{r.get('n_params', 0) / 1e6:.1f}M",
                f"{fmt_ms(float(r['replica_s']) * 1e3)} ({bits})",
                f"{r.get('steps_per_block', '?')} steps × {len(r.get('replica_block_s', []))}",
                f"bare {kernel} {fmt_ms(float(r['bare_s']) * 1e3)}",
                f"{float(r['ratio']):.2f}x",
                target,
                yes_no(float(r["ratio"]) <= REPLICA_TARGET),
            ]
        )
    return rows


def cuda_test_rows(res: Results) -> list[list[str]]:
    """The CUDA tests' counts, then one row per test that failed (ten at most)."""
    check = "CUDA tests (pytest -m gpu)"
    t = res.tests
    if t is None:
        return [[check, "not run (tests)", "", "", "", "all pass", ""]]
    text = (
        f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
    )
    if not t["complete"]:
        text += " (log ends before pytest's summary: stopped)"
    ok = t["complete"] and t["failed"] == 0 and t["errors"] == 0 and t["passed"] > 0
    rows = [[check, text, "", "", "", "all pass", yes_no(ok)]]
    rows += [[f"failed: {name}", "", "", "", "", "", ""] for name in t["failures"][:10]]
    return rows


def recovery_rows(res: Results) -> list[list[str]]:
    """One row per recovery case: its time to the first new step, against torch.save's."""
    if res.recovery is None:
        return [["recovery (to the first new step)", "not run (recovery)", "", "", "", "", ""]]
    rows = []
    base = {
        r["full_every"]: r["first_new_step_s"]
        for r in res.recovery
        if r.get("method") == "torch.save" and r.get("first_new_step_s")
    }
    for r in res.recovery:
        t = r.get("first_new_step_s")
        if t is None:
            continue
        b = base.get(r["full_every"])
        sooner = f"{b / t:.1f}x sooner" if b and r.get("method") != "torch.save" else ""
        rows.append(
            [
                f"recovery, f = {r['full_every']}: {r['method']}",
                f"{fmt_s(t)} to the first new step",
                f"{r.get('restarts', 1)} restart(s)",
                f"torch.save {fmt_s(b)}" if b and sooner else "",
                sooner,
                "",
                "",
            ]
        )
    return rows


def header(res: Results) -> str:
    """The line above the table: where it ran (``env.json``, else what the results say;
    what none of them says is left out)."""
    env = res.env or {}
    seen = [env, *(run for _, run in res.references), *(res.replica or [])]

    def known(*keys: str) -> Any:
        return next((d[k] for d in seen for k in keys if d.get(k)), None)

    if res.env is not None and not env.get("gpu"):
        gpu = "no CUDA device"
    else:
        gpu = known("gpu", "device") or "GPU not recorded"
    if env.get("gpu_memory_bytes"):
        gpu += f" ({env['gpu_memory_bytes'] / 2**30:.0f} GiB)"
    parts = [gpu]
    for key, text in (("torch", "torch {}"), ("cuda", "CUDA {}"), ("cpus", "{} host cores")):
        if known(key):
            parts.append(text.format(known(key)))
    parts.append(f"lowdiff {known('lowdiff') or 'version not recorded'}")
    if known("git"):
        parts.append(f"git {known('git')}")
    copy = env.get("copy_gbps") or {}
    if "shared_registered" in copy:
        parts.append(f"device to page-locked shared memory {copy['shared_registered']:.1f} GB/s")
    elif "shared_not_registered" in copy:
        parts.append("shared memory could NOT be page-locked")
    if res.env is None:
        parts.append("env not run")
    return " · ".join(parts)


def summary(res: Results) -> str:
    """The header line and the one table, in Markdown."""
    body = reference_rows(res) + replica_table_rows(res) + cuda_test_rows(res) + recovery_rows(res)
    lines = [
        "## GPU check",
        "",
        header(res),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the machine


def environment(copy_check: bool = True) -> dict[str, Any]:
    """This machine for the header: GPU, torch, CUDA, transformers, lowdiff, host cores
    and memory, git revision, and (``copy_check`` and CUDA) the copy bandwidths of
    ``gpu_copy_check.py``."""
    import torch

    import lowdiff

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_reference import git_revision

    info: dict[str, Any] = {
        "kind": "gpu-env",
        "machine": platform.node(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lowdiff": lowdiff.__version__,
        "cpus": os.cpu_count(),
        "host_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "python": platform.python_version(),
        "git": git_revision(),
        "gpu": None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
        if copy_check:
            import gpu_copy_check

            info["copy_gbps"] = gpu_copy_check.main(["--mib", "512", "--repeats", "5"])
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "out",
        nargs="?",
        type=Path,
        default=Path(os.environ.get("OUT", "/tmp/gpu-check")),
        help="the folder gpu_check.sh wrote (default: $OUT, else /tmp/gpu-check)",
    )
    ap.add_argument(
        "--write-env",
        type=Path,
        default=None,
        metavar="FILE",
        help="write this machine's description (and its copy bandwidths) to FILE instead",
    )
    args = ap.parse_args(argv)
    if args.write_env is not None:
        info = environment()
        args.write_env.write_text(json.dumps(info, indent=2))
        print(json.dumps({k: v for k, v in info.items() if k != "kind"}))
        return 0
    print(summary(load(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
