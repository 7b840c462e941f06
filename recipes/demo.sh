#!/usr/bin/env bash
# The main job (`make demo`): pretrain the tiny GPT recipe end to end on the shipped Tiny Shakespeare, on CPU.
#   1. train a byte-level BPE tokenizer (or reuse it)   -> runs/tokenizers/tinyshakespeare-bpe1k.json
#   2. prepare the corpus into token shards (cached)   -> runs/data/tinyshakespeare-bpe1k/
#   3. train (resumes if interrupted; re-running after completion does no more steps)
#                                                        -> runs/gpt-tiny/checkpoints/last.ckpt, W&B offline run, CSV
#   4. generate a sample from the checkpoint
# Extra arguments are config overrides for every step, e.g. `bash recipes/demo.sh trainer.max_steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."

pretrain() { "${PYTHON:-python3}" -m pretrain "$@"; }
RECIPE=recipes/gpt-tiny.yaml

pretrain tokenizer "$RECIPE" "$@"
pretrain prepare "$RECIPE" "$@"
pretrain fit "$RECIPE" "$@"
RUN_DIR=$(pretrain fit "$RECIPE" "$@" --print-config | sed -n 's/^run_dir: //p')
echo
echo "== a sample from $RUN_DIR/checkpoints/last.ckpt =="
pretrain generate "$RUN_DIR/checkpoints/last.ckpt" --prompt "ROMEO:" --max-new-tokens 120 --temperature 0.8 \
    --top-k 40 --seed 0
