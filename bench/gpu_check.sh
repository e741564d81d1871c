#!/usr/bin/env bash
# The sharded trainer's GPU check, for one lent GPU machine (docs/MULTINODE.md, "GPU check";
# results go to docs/results/fsdp_scaling.md). Run from the repository root:
#
#     bash bench/gpu_check.sh    # carry [".whl"]: the wheels the image lacks + the tiny model
#
# Steps, each bounded by `timeout` and by the whole run's budget (GPU_CHECK_BUDGET_S, 360 s):
#   1. the `gpu` tests (tests/gpu);
#   2. the trainer's sharded path on CUDA with NCCL at world size 1 under torchrun (small and
#      base models, bf16): step time, CUDA peak memory, the gather to rank 0, a DCP sharded
#      checkpoint + exact resume, and the Hugging Face export (bench/trainer/fsdp_scaling.py);
#   3. two ranks on the one GPU with NCCL (bench/trainer/nccl_same_gpu.py; refusal expected);
#   4. gather-to-rank-0 vs per-rank sends, gloo on CPU (bench/sync/sharded_paths.py);
#   5. bench/trainer/fsdp_scaling.py on CPU with gloo at 1, 2 and 4 ranks (tiny and small).
# Everything lands in $OUT (default /tmp/gpu_check): gpu_check.log and one JSON per bench.
# Without CUDA the CUDA steps say "skipped" and the rest runs; GPU_CHECK_QUICK=1 shrinks every
# CPU step to tiny settings (how the script is tried on a CPU box); GPU_CHECK_CPU_STEPS=0 skips
# steps 4-5 (a rerun that only wants the CUDA numbers).
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
BUDGET=${GPU_CHECK_BUDGET_S:-360}
QUICK=${GPU_CHECK_QUICK:-0}
CPU_STEPS=${GPU_CHECK_CPU_STEPS:-1}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

# what the image lacks: the carried wheels and the tiny model (bench/gpu_env.sh)
source bench/gpu_env.sh

log() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }

# step NAME LIMIT_S CMD...: run CMD under the smaller of LIMIT_S and what the budget has left.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS - 5))
    ((left < limit)) && limit=$left
    if ((limit < 15)); then
        log "SKIP $name (budget spent)"
        return 0
    fi
    log "START $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    log "END $name rc=$rc$( ((rc == 124)) && echo ' (timed out)')"
}

: >"$LOG"
log "budget ${BUDGET}s, quick=$QUICK, out=$OUT"
python3 - >"$OUT/env.json" 2>>"$LOG" <<'EOF'
import json, os, platform, torch
from torch.distributed.fsdp import FSDPModule
info = {"torch": torch.__version__, "python": platform.python_version(),
        "cuda": torch.cuda.is_available(), "cpus": os.cpu_count(),
        "fsdp_api": {m: hasattr(FSDPModule, m) for m in
                     ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms")}}
if torch.cuda.is_available():
    info |= {"gpu": torch.cuda.get_device_name(), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
for mod in ("transformers", "peft", "pydantic", "safetensors"):
    info[mod] = __import__(mod).__version__
print(json.dumps(info, indent=1))
EOF
cat "$OUT/env.json" >>"$LOG"
lscpu | grep -E "^(Model name|CPU\(s\))" >>"$LOG"
uptime >>"$LOG"
CUDA=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

MODELS="'tiny', 'small', 'base'"
((QUICK)) && MODELS="'tiny',"
step "build bench models" 60 python3 -c "from bench.common import model_dir; [model_dir(m) for m in ($MODELS)]"

if ((CUDA)); then
    step "pytest -m gpu" 120 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
    step "fsdp small cuda world 1" 75 python3 -m bench.trainer.fsdp_scaling --device cuda --model small \
        --ranks 1 --steps 3 --threads 4 --checkpoint --results "$OUT/fsdp_cuda.json"
    step "nccl 2 ranks on 1 GPU" 60 python3 -m bench.trainer.nccl_same_gpu --ranks 2 --timeout 45 \
        --out "$OUT/nccl_same_gpu.json"
else
    log "SKIP CUDA steps (no CUDA device)"
fi

if ((!CPU_STEPS)); then
    log "SKIP CPU steps (GPU_CHECK_CPU_STEPS=0)"
elif ((QUICK)); then
    step "sync paths tiny" 60 python3 -m bench.sync.sharded_paths --model tiny --trainers 2 \
        --rounds 3 --results "$OUT/sync_paths.json"
    step "fsdp cpu tiny" 120 python3 -m bench.trainer.fsdp_scaling --model tiny --ranks 1,2 --steps 1 \
        --groups 2 --group-size 2 --prompt 64 --completion 16 --micro-tokens 160 \
        --results "$OUT/fsdp_cpu.json"
else
    step "sync paths tiny" 40 python3 -m bench.sync.sharded_paths --model tiny --trainers 2,4 \
        --rounds 5 --results "$OUT/sync_paths.json"
    step "sync paths small" 50 python3 -m bench.sync.sharded_paths --model small --trainers 2,4 \
        --rounds 5 --results "$OUT/sync_paths.json"
    step "fsdp cpu tiny" 60 python3 -m bench.trainer.fsdp_scaling --model tiny --ranks 1,2,4 --steps 3 \
        --results "$OUT/fsdp_cpu.json"
    step "fsdp cpu small" 150 python3 -m bench.trainer.fsdp_scaling --model small --ranks 1,2,4 \
        --steps 2 --results "$OUT/fsdp_cpu.json"
fi
if ((CUDA)); then
    step "fsdp base cuda world 1" 60 python3 -m bench.trainer.fsdp_scaling --device cuda --model base \
        --ranks 1 --steps 3 --threads 4 --checkpoint --results "$OUT/fsdp_cuda.json"
fi
uptime >>"$LOG"
log "done; files: $(ls "$OUT" | tr '\n' ' ')"
