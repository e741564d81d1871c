#!/usr/bin/env bash
# Issue 25's CUDA rows (docs/results/trainer_packing_cuda.md) and the GPU check, in one call on a lent GPU machine
# (no dataset and no hub there: the inputs travel, prepared here). On the CPU box first:
#
#     mkdir -p .whl/models && cp -r artifacts/models/tiny-qwen2 .whl/models/
#     mkdir -p .whl/models/smol-shape && cp artifacts/models/smollm2-135m-instruct/{config.json,\
#         tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} \
#         .whl/models/smol-shape/
#     .venv/bin/python -m bench.trainer.packing --preset cpu-smol --groups 4 --rounds 1 --sft \
#         --write-inputs .whl/inputs_smol.json
#     .venv/bin/python -m bench.trainer.packing --preset cpu-tiny --group-sizes 8 --groups 4 \
#         --rounds 1 --sft --write-inputs .whl/inputs_tiny.json
#     (+ the wheels of docs/MULTINODE.md "GPU check", pydantic-settings, python-dotenv, tenacity)
#
# then there, from the repository root with .whl carried: OUT=/tmp/out bash bench/cuda_rows.sh
#   1. SmolLM2-135M's shape with random weights (timing does not depend on the values: the
#      real weights are 517 MB, over what a call carries), bf16 autocast (`precision: auto`):
#      bench/trainer/packing.py padded vs prefix tree at G = 4, 8, 16 and SFT, 3 steps each;
#   2. the tiny default (the embedded model itself) at G = 8 and SFT;
#   3. bench/gpu_check.sh's CUDA steps (the `gpu` tests, which include the tree's CUDA
#      equality tests, FSDP2 at world size 1, two NCCL ranks on one GPU).
set -u
OUT=${OUT:-/tmp/cuda_rows}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
LOG=$OUT/cuda_rows.log
source bench/gpu_env.sh 2>>"$LOG"  # the carried wheels and the tiny model
{
    nvidia-smi -L
    python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = ".whl/models/smol-shape", "/tmp/smol-random"
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(dst)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    open(f"{dst}/{f}", "wb").write(open(f"{src}/{f}", "rb").read())
print("random-weight SmolLM2 shape at", dst)
PY
    timeout 300 python3 -m bench.trainer.packing --preset cpu-smol --model /tmp/smol-random \
        --device cuda --inputs .whl/inputs_smol.json --groups 4 --rounds 1 --steps 3 --sft \
        --out "$OUT/trainer_packing_cuda.json"
    timeout 120 python3 -m bench.trainer.packing --preset cpu-tiny \
        --model .whl/models/tiny-qwen2 --device cuda \
        --inputs .whl/inputs_tiny.json --group-sizes 8 --groups 4 --rounds 1 --steps 3 --sft \
        --out "$OUT/trainer_packing_cuda.json"
} >>"$LOG" 2>&1
GPU_CHECK_CPU_STEPS=0 GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-240} OUT=$OUT/gpu_check \
    bash bench/gpu_check.sh
