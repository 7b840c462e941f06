#!/usr/bin/env bash
# One-shot GPU check (see benchmarks/gpu_check.py): on a bare CUDA machine with this repository copied over,
#   bash benchmarks/gpu_check.sh [--out DIR] [--wheels DIR] [--legs data,train,...]   (results: $OUT or --out)
#   bash benchmarks/gpu_check.sh --cpu                                                 (CPU mode, tiny model)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
