#!/usr/bin/env bash
# The GPU checks, phase by phase, on a machine with CUDA and PyTorch already installed:
#
#     bash benchmarks/gpu_check.sh env tests ref117m      # about 3 minutes on an H200
#     bash benchmarks/gpu_check.sh ref1b                  # about 3 minutes
#     bash benchmarks/gpu_check.sh recovery               # more than 3 minutes
#
# Phases (each bounded by its own timeout, each independent of the others):
#   env       the GPU, the CPU, torch, memory and disk; whether shared memory can be
#             page-locked here, and device-to-host copy bandwidth into each kind of
#             host memory (benchmarks/gpu_copy_check.py)
#   tests     every CUDA test (pytest -m gpu): the CUDA record and snapshot paths, the
#             SIGKILL of a CUDA trainer and its resume, for LowDiff and LowDiff+
#   ref117m   benchmarks/gpu_reference.py on the 117.8M-parameter GPT-2: plain, TopK,
#             LowDiff and LowDiff+ interleaved, then plain and DCP async_save every step
#   ref1b     plain, TopK and LowDiff on the 1.04B-parameter GPT-2 (LowDiff+ there is
#             held to its CPU replica, 3.3 s a step on an H200 host; DCP would save
#             12.5 GB a step)
#   recovery  lowdiff bench recovery (Exp. 5) on gpt2-s: LowDiff, LowDiff+ (S),
#             torch.save and Gemini (S)
# Logs and JSON go to $OUT (default /tmp/gpu-check); checkpoints to .gpu-work/.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
WORK="$PWD/.gpu-work"
mkdir -p "$WORK"
threads=$(( $(nproc) > 4 ? $(nproc) - 2 : 1 ))

for phase in "$@"; do
    echo "=== $phase $(date +%T)"
    case "$phase" in
    env)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        $PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, torch.cuda.get_device_name(0))'
        echo "cpus $(nproc)"; free -g | head -2; df -h "$WORK" | tail -1
        git rev-parse --short HEAD 2>/dev/null
        timeout 60 $PY benchmarks/gpu_copy_check.py 2>&1 | tee "$OUT/copy.log"
        ;;
    tests)
        timeout 120 $PY -m pytest -q -p no:cacheprovider -m gpu --timeout 150 -rA \
            tests/process/test_cuda_handoff.py tests/process/test_sigkill_recovery.py \
            tests/workloads/test_zoo.py tests/baselines/test_checkfreq.py \
            2>&1 | tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|skipped|Error" | tail -40
        ;;
    ref117m)
        timeout 200 $PY benchmarks/gpu_reference.py --arms plain,topk,lowdiff,lowdiff+ \
            --steps 40 --warmup 5 --repeats 3 --replica-threads "$threads" \
            --workdir "$WORK" --json "$OUT/ref117m.json" 2>&1 | tee "$OUT/ref117m.log" | tail -20
        # DCP saves the whole state every step (1.4 GB): shorter blocks
        timeout 200 $PY benchmarks/gpu_reference.py --arms plain,dcp \
            --steps 12 --warmup 3 --repeats 3 \
            --workdir "$WORK" --json "$OUT/ref117m-dcp.json" 2>&1 | tee "$OUT/ref117m-dcp.log" | tail -8
        ;;
    ref1b)
        timeout 240 $PY benchmarks/gpu_reference.py --model gpt2-1b --batch 16 --accum 4 \
            --arms plain,topk,lowdiff --steps 20 --warmup 2 --repeats 2 \
            --workdir "$WORK" --json "$OUT/ref1b.json" 2>&1 | tee "$OUT/ref1b.log" | tail -20
        ;;
    recovery)
        timeout 330 $PY -m lowdiff bench recovery --quick --workload gpt2-s --device cuda \
            --amp bf16 --methods lowdiff,lowdiff+,torch-save,gemini --repeats 1 \
            --workdir "$WORK" --out "$WORK/recovery" --quiet 2>&1 | tail -30
        cp "$WORK/recovery/report.md" "$OUT/recovery-report.md" 2>/dev/null
        cp "$WORK/recovery/results.jsonl" "$OUT/recovery-results.jsonl" 2>/dev/null
        grep -A30 -i "recovery" "$WORK/recovery/report.md" 2>/dev/null | head -40
        ;;
    *)
        echo "unknown phase $phase" >&2
        ;;
    esac
done
echo "=== end $(date +%T)"
