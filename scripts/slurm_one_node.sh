#!/usr/bin/env bash
# recipes/slurm.sbatch through a real one-node SLURM cluster on this machine (munge, slurmctld and slurmd on
# localhost), 2 CPU tasks (gloo DDP):
#   1. an uninterrupted job (the reference);
#   2. the same job sent SIGUSR1 mid-run (`scancel --signal=USR1`, what `--signal=USR1@90` sends before the
#      time limit): it saves after the step, requeues itself and exits 138; the requeued job resumes
#      (resume=auto) and finishes.
# Then: both jobs' final weights must be bitwise equal, and every launch must log the reference's losses.
# Before the jobs: `pretrain prepare`'s SLURM executor (datatrove job array) must match plain prepare byte for byte,
# and `pretrain ladder --executor slurm` (a reduced ladder, one array task per cell) must give every cell the final
# loss of the same ladder run as local processes, then fit and predict its held-out cell.
# Needs root and Debian's slurm-wlm (apt-get install slurm-wlm; tested with Slurm 22.05). Not in CI: it starts
# daemons and takes minutes.
#
#   bash scripts/slurm_one_node.sh [WORK_DIR]    (default /tmp/pretrain-slurm)
#   STAGES="prepare ladder jobs" (the default: all three) runs the named stages only
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/pretrain-slurm}
PYTHON=${PYTHON:-python}
for tool in munged slurmctld slurmd sbatch scontrol scancel; do
    command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install slurm-wlm" >&2; exit 2; }
done
rm -rf "$WORK" && mkdir -p "$WORK/slurm/state" "$WORK/slurm/spool"
export SLURM_CONF=$WORK/slurm/slurm.conf
cat > "$SLURM_CONF" <<EOF
ClusterName=local
SlurmctldHost=$(hostname)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmctldPidFile=$WORK/slurm/slurmctld.pid
SlurmdPidFile=$WORK/slurm/slurmd.pid
SlurmdSpoolDir=$WORK/slurm/spool
StateSaveLocation=$WORK/slurm/state
SlurmctldLogFile=$WORK/slurm/slurmctld.log
SlurmdLogFile=$WORK/slurm/slurmd.log
ReturnToService=2
JobRequeue=1
MpiDefault=none
NodeName=$(hostname) CPUs=$(nproc) RealMemory=$(($(free -m | awk '/Mem:/ {print $2}') / 2)) State=UNKNOWN
PartitionName=local Nodes=$(hostname) Default=YES MaxTime=INFINITE State=UP
EOF
mkdir -p /run/munge && (pgrep -x munged >/dev/null || munged --force)
scontrol shutdown >/dev/null 2>&1 || true
slurmctld -i && slurmd
trap 'scontrol shutdown >/dev/null 2>&1 || true' EXIT
for _ in $(seq 30); do sinfo -h -o %t 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo

cd "$WORK"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} WANDB_MODE=offline
TINY=(model.n_layer=2 model.d_model=64 model.d_ff=256 data.seq_len=64 data.micro_batch_size=8
      trainer.max_steps=60 trainer.val_check_interval=20 checkpoint.every_n_steps=5 checkpoint.save_top_k=0
      trainer.log_every_n_steps=1 trainer.progress_bar=false logger.wandb.enabled=false
      strategy.name=ddp strategy.ddp.process_group_backend=gloo)
$PYTHON -m pretrain tokenizer "$REPO/recipes/gpt-tiny.yaml"
$PYTHON -m pretrain prepare "$REPO/recipes/gpt-tiny.yaml"

STAGES=${STAGES:-prepare ladder jobs}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
wait_queue() { while squeue -h | grep -q .; do sleep 2; done; }

# `prepare --executor slurm` with dedup exact: the corpus in 2 files -> a 2-task datatrove job array for the scan
# stage (hashes), then one for the tokenize stage; each rerun of the same call goes on, the last assembles the
# shards, which must hold, byte for byte, what plain `prepare` writes
stage prepare && $PYTHON - "$REPO" <<'PY'
import subprocess, sys, time
from pathlib import Path

from pretrain.datamodules.executors import prepare_in_tasks
from pretrain.datamodules.prepare import prepare, split_prefixes

text = (Path(sys.argv[1]) / "recipes/data/tinyshakespeare.txt").read_text()
parts = [Path(f"part{i}.txt") for i in range(2)]
for i, part in enumerate(parts):
    part.write_text(text[i * len(text) // 2 : (i + 1) * len(text) // 2] + text[:20_000])  # repeats
tok = "runs/tokenizers/tinyshakespeare-bpe1k.json"
settings = {"val_fraction": 0.05, "dedup": "exact"}
plain = prepare(parts, tok, "prepared-plain", progress=False, **settings)
options = {"partition": "local", "time": "00:10:00", "mem_per_cpu_gb": 1}
stages = []
while (meta := prepare_in_tasks(parts, tok, "prepared-slurm", executor="slurm", tasks=2, executor_options=options, **settings)).get("submitted"):
    stages.append(meta["stage"])
    print(f"submitted {meta['stage']}: tasks {meta['tasks_pending']} pending")
    while subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip():
        time.sleep(2)
assert stages == ["scan", "tokenize"], stages
for split in ("train", "val"):
    joined = b"".join(Path(f"{p}.bin").read_bytes() for p in split_prefixes("prepared-slurm", split))
    assert joined == Path(f"prepared-plain/{split}.bin").read_bytes(), split
assert meta["cache_key"] == plain["cache_key"] and meta["shards"] == ["00000", "00001"]
assert meta["duplicates_dropped"] == plain["duplicates_dropped"] > 0
print(f"OK: prepare --executor slurm (2 stages of 2 array tasks, dedup exact) = plain prepare, byte for byte ({meta['splits']}, {meta['duplicates_dropped']} duplicates)")
PY

# `pretrain ladder --executor slurm`: tests/integration/test_ladder.py's reduced ladder (3 sizes x 3 budgets), its
# 9 cells one array task each; the call returns once submitted, the same call after the array ends fits. The same
# ladder as local processes is the reference: every cell's final validation loss must be equal.
if stage ladder; then
    LADDER=("ladder.sizes=[{d_model: 32, n_layer: 1}, {d_model: 32, n_layer: 2}, {d_model: 64, n_layer: 2}]"
            "ladder.flops=[3e10, 6e10, 1.2e11]" ladder.min_steps=30 ladder.val_batches=16 ladder.bootstrap=30
            data.micro_batch_size=8 logger.wandb.enabled=false)
    cp "$REPO/recipes/ladder-tiny.yaml" ladder.yaml
    $PYTHON -m pretrain ladder ladder.yaml --out ladder-slurm --executor slurm --partition local --time 00:30:00 \
        "${LADDER[@]}" | tail -1
    $PYTHON -m pretrain ladder ladder.yaml --out ladder-local --workers 2 "${LADDER[@]}" | tail -3
    wait_queue
    $PYTHON -m pretrain ladder ladder.yaml --out ladder-slurm --executor slurm "${LADDER[@]}" | tail -3
    $PYTHON - <<'PY'
import json
from pathlib import Path

cells = {p.parent.name: json.loads(p.read_text())["loss"] for p in Path("ladder-local/runs").glob("*/result.json")}
slurm = {p.parent.name: json.loads(p.read_text())["loss"] for p in Path("ladder-slurm/runs").glob("*/result.json")}
assert len(cells) == 9 and slurm == cells, (slurm, cells)
report = json.loads(Path("ladder-slurm/ladder.json").read_text())
held = report["held_out"]
assert report["fit"]["cells"] == 8 and held["cell"] == "d64-l2-c1.2e11", report
print(f"OK: pretrain ladder --executor slurm: 9 array tasks, every cell's loss equal to the local ladder's; "
      f"held out {held['cell']}: predicted {held['predicted']:.4f}, actual {held['actual']:.4f} ({held['rel_error']:+.2%})")
PY
fi
stage jobs || exit 0

submit() {  # RUN_DIR -> job id
    sbatch --parsable --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 --time=30 \
        --export=ALL "$REPO/recipes/slurm.sbatch" "$REPO/recipes/gpt-tiny.yaml" "${TINY[@]}" run_dir="$1"
}
state() { scontrol show job "$1" | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
wait_done() {
    while [ "$(state "$1")" != COMPLETED ]; do
        case $(state "$1") in FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) echo "job $1: $(state "$1")" >&2; exit 1;; esac
        sleep 2
    done
}

reference=$(submit runs/reference)
echo "reference job $reference"
wait_done "$reference"

job=$(submit runs/preempted)
echo "preempted job $job"
$PYTHON - "$job" <<'PY'
import subprocess, sys, time
from pathlib import Path

import torch

last = Path("runs/preempted/checkpoints/last.ckpt")
step = -1
while step < 10:
    time.sleep(0.2)
    try:
        step = torch.load(last, weights_only=True, mmap=True)["global_step"]
    except Exception:  # not written yet, or being replaced
        pass
subprocess.run(["scancel", "--signal=USR1", sys.argv[1]], check=True)
print(f"sent SIGUSR1 to job {sys.argv[1]} once step {step} had been saved")
PY
wait_done "$job"
scontrol show job "$job" | grep -o "Restarts=[0-9]*"

$PYTHON - "$WORK" "$job" <<'PY'
import csv, sys
from pathlib import Path
import torch

work, job = Path(sys.argv[1]), sys.argv[2]
def launches(run):
    return [{int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(open(v / "metrics.csv")) if r.get("train/loss")}
            for v in sorted((run / "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))]
reference = launches(work / "runs/reference")[0]
resumed = launches(work / "runs/preempted")
log = (work / f"slurm-pretrain-{job}.out").read_text()
print(f"launches of the preempted job: {[(min(l), max(l)) for l in resumed]}")
print("log:", *[line for line in log.splitlines() if "SIGUSR1" in line or "steps:" in line or "continue with" in line], sep="\n  ")
assert len(resumed) == 2 and "stopped by SIGUSR1" in log
assert all(l == {s: reference[s] for s in l} for l in resumed), "losses differ from the uninterrupted job"
a, b = (torch.load(work / f"runs/{r}/checkpoints/last.ckpt", weights_only=True)["state_dict"] for r in ("reference", "preempted"))
assert all(torch.equal(a[k], b[k]) for k in a), "final weights differ"
print(f"OK: SIGUSR1 -> save, requeue, resume; {len(reference)} steps, every loss and the final weights equal")
PY
