#!/usr/bin/env bash
# Every benchmark with its defaults, one after another (`make bench`); each prints its ratios against a peer.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
for script in bench_model bench_objectives bench_sparse_targets bench_prepare bench_dataloader \
    bench_lightning_overhead bench_step_overhead bench_end_to_end bench_compile bench_generation bench_evaluation; do
    [ -f "benchmarks/$script.py" ] || continue
    echo "== $script =="
    "${PYTHON:-python3}" "benchmarks/$script.py" || { echo "$script failed"; status=1; }
done
exit $status
