#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA, PyTorch and transformers installed, run from the
# repository's root; one Markdown table of every result at the end:
#
#     bash benchmarks/gpu_check.sh                   # every phase, in 9 minutes at most
#     bash benchmarks/gpu_check.sh ref117m replica   # the phases named, in that order
#
# Phases, in this order by default, each bounded by its own timeouts (535 s in all; the
# figures are 16 host cores and an H200, where `threads` is 14):
#   env       25 s  the GPU, CPU, memory and disk; torch, CUDA, transformers and lowdiff;
#                   whether shared memory can be page-locked, and device-to-host copy
#                   bandwidth into each kind of host memory (gpu_copy_check.py)
#   tests     75 s  every CUDA test (pytest -m gpu): the CUDA record and snapshot paths,
#                   the SIGKILL of a CUDA trainer and its resume, LowDiff and LowDiff+
#   ref117m   85 s  gpu_reference.py on the 117.8M-parameter GPT-2, arms interleaved:
#                   plain, TopK and LowDiff in blocks of 40 steps, LowDiff+ of 20 and DCP
#                   async_save every step (1.4 GB a step) of 8; 3 repeats; restore check
#   ref1b    195 s  the 1.04B-parameter GPT-2 (4 micro-batches of 16): plain, TopK and
#                   LowDiff in blocks of 6 steps, LowDiff+ (about 3.3 s a step) of 2,
#                   2 repeats; then plain and DCP (12.5 GB a step) in blocks of 4 and 2,
#                   2 repeats, in a run of their own (disk space). Under 120 GiB of GPU
#                   memory LowDiff+ is left out there.
#   replica   70 s  the LowDiff+ replica's CPU update against a bare fused CPU AdamW step,
#                   GPT-2-117.8M shapes, gradient clipping that fires, 1, 2, 4, 8 and
#                   `threads` threads
#   recovery  85 s  lowdiff bench recovery (Exp. 5) on gpt2-s, f = 5: torch.save, LowDiff,
#                   LowDiff (S), LowDiff+ (S)
# The gpu_reference.py runs leave out further blocks once their --time-budget is spent
# and write their JSON after every block, the replica phase after every thread count, so
# a phase cut short by its timeout (SIGTERM, SIGKILL 5 s later) leaves what it finished.
# Then benchmarks/gpu_summary.py prints the table of whatever is in $OUT (also written to
# $OUT/summary.md). $OUT (default /tmp/gpu-check) holds 8 files: env.json, tests.log,
# ref117m.json, ref1b.json, ref1b-dcp.json, replica.json, recovery.jsonl, summary.md;
# each phase first removes its own. Logs and checkpoints go to .gpu-work/.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
WORK="$PWD/.gpu-work"
LOGS="$WORK/logs"
mkdir -p "$LOGS"
threads=$(( $(nproc) > 4 ? $(nproc) - 2 : 1 ))
[ $# -gt 0 ] || set -- env tests ref117m ref1b replica recovery

for phase in "$@"; do
    echo "=== $phase $(date +%T)"
    case "$phase" in
    env)
        rm -f "$OUT/env.json"
        timeout -k 2 5 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        echo "cpus $(nproc)"; free -g | head -2; df -h "$WORK" | tail -1
        timeout -k 5 20 $PY benchmarks/gpu_summary.py --write-env "$OUT/env.json"
        ;;
    tests)
        rm -f "$OUT/tests.log"
        timeout -k 5 75 $PY -m pytest -v -p no:cacheprovider -m gpu --timeout 60 -rfEs \
            tests/process/test_cuda_handoff.py tests/process/test_sigkill_recovery.py \
            tests/workloads/test_zoo.py tests/baselines/test_checkfreq.py \
            >"$OUT/tests.log" 2>&1
        grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -10
        tail -1 "$OUT/tests.log"
        ;;
    ref117m)
        rm -f "$OUT/ref117m.json"
        timeout -k 5 85 $PY benchmarks/gpu_reference.py --arms plain,topk,lowdiff,lowdiff+,dcp \
            --steps 40 --arm-steps lowdiff+=20,dcp=8 --warmup 5 --repeats 3 --time-budget 65 \
            --replica-threads "$threads" --workdir "$WORK" --json "$OUT/ref117m.json" \
            2>&1 | tee "$LOGS/ref117m.log" | tail -22
        ;;
    ref1b)
        rm -f "$OUT/ref1b.json" "$OUT/ref1b-dcp.json"
        gpu_mib=$(timeout -k 2 5 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
        arms=plain,topk,lowdiff,lowdiff+
        if [ "${gpu_mib:-0}" -lt 122880 ]; then
            arms=plain,topk,lowdiff  # four 1.04B arms with AdamW need about 80 GB
        fi
        timeout -k 5 115 $PY benchmarks/gpu_reference.py --model gpt2-1b --batch 16 --accum 4 \
            --arms "$arms" --steps 6 --arm-steps lowdiff+=2 --warmup 1 --repeats 2 \
            --time-budget 90 --no-restore-check --replica-threads "$threads" \
            --workdir "$WORK" --json "$OUT/ref1b.json" 2>&1 | tee "$LOGS/ref1b.log" | tail -18
        # DCP keeps two 12.5 GB checkpoints and writes a third: apart from LowDiff's
        timeout -k 5 75 $PY benchmarks/gpu_reference.py --model gpt2-1b --batch 16 --accum 4 \
            --arms plain,dcp --steps 4 --arm-steps dcp=2 --warmup 1 --repeats 2 \
            --time-budget 50 --workdir "$WORK" --json "$OUT/ref1b-dcp.json" \
            2>&1 | tee "$LOGS/ref1b-dcp.log" | tail -10
        ;;
    replica)
        rm -f "$OUT/replica.json"
        timeout -k 5 70 $PY -c '
import json, os, sys
import torch
import lowdiff
from lowdiff_lab.bench.replica import format_rows, replica_update_bench

most, out = int(sys.argv[1]), sys.argv[2]
info = {"torch": torch.__version__, "lowdiff": lowdiff.__version__, "cpus": os.cpu_count()}
rows = []
for n in sorted({t for t in (1, 2, 4, 8) if t <= most} | {most}, reverse=True):
    rows += replica_update_bench(
        shapes="gpt2-117m",
        clip=True,
        threads=(n,),
        kernels=(("torch.optim.AdamW", {"fused": True}),),
        repeats=5,
        steps=3,
        progress=print,
    )
    with open(out + ".tmp", "w") as f:  # after every count: a timeout leaves the rows done
        json.dump({"kind": "replica", **info, "rows": rows}, f, indent=2)
    os.replace(out + ".tmp", out)
print(format_rows(sorted(rows, key=lambda r: r["threads"])))
' "$threads" "$OUT/replica.json" 2>&1 | tee "$LOGS/replica.log" | tail -12
        ;;
    recovery)
        rm -f "$OUT/recovery.jsonl"
        rm -rf "$WORK/recovery"
        timeout -k 5 85 $PY -c '
import sys
from pathlib import Path
from lowdiff_lab.bench import run_bench
from lowdiff_lab.bench.context import Profile
from lowdiff_lab.bench.core import BenchSettings

work = Path(sys.argv[1])
settings = BenchSettings("gpt2-s", device="cuda", amp="bf16", repeats=1, workdir=work)
run_bench(
    ["recovery"],
    out=work / "recovery",
    settings=settings,
    profile=Profile(recovery_fulls=[5]),
    methods=["lowdiff", "lowdiff+", "torch-save"],
    progress=print,
)
' "$WORK" 2>&1 | tee "$LOGS/recovery.log" | tail -8
        cp "$WORK/recovery/results.jsonl" "$OUT/recovery.jsonl" 2>/dev/null
        grep -A12 "^## Recovery" "$WORK/recovery/report.md" 2>/dev/null | tail -8
        ;;
    *)
        echo "unknown phase $phase (known: env tests ref117m ref1b replica recovery)" >&2
        ;;
    esac
    rm -f "$OUT"/*.tmp  # a JSON being replaced when its phase was stopped
done
echo "=== summary $(date +%T)"
$PY benchmarks/gpu_summary.py "$OUT" | tee "$OUT/summary.md"
