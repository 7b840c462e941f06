#!/usr/bin/env bash
# GPU smoke run (needs a CUDA GPU; exits 0 with a note otherwise): GPT-2 124M in bf16 with torch.compile and
# FlashAttention for ~200 steps, then DeepSpeed ZeRO-2 and FSDP for 20 steps each; prints tokens/s and MFU.
#   bash benchmarks/gpu_smoke.sh [--steps 200] [--sharded-steps 20] [--micro-batch 16]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_smoke.py "$@"
