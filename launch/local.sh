#!/usr/bin/env bash
# Train on this machine: all GPUs, or 4 CPU processes without one (NPROC=N to choose).
#   ./launch/local.sh [ENTRY] [overrides]
# ENTRY: the entry point, dtrain.ENTRY (sft, the default; dpo; each objective's: launch/entry_point.sh);
# the rest are Hydra overrides, e.g.  ./launch/local.sh +experiment=llama3_tp4 train.max_steps=10,
# ./launch/local.sh dpo dpo.beta=0.2
# Rank 0 keeps the terminal (its progress bar and lines; its log is also RUN_DIR/ENTRY.log); every
# other rank writes to LOG_DIR/<id>/attempt_0/<rank>/{stdout,stderr}.log (LOG_DIR: logs/), and
# torchrun's own messages and failure report to LOG_DIR/<id>/torchrun.log.
# This script becomes the launcher (dtrain.launch: torchrun, run by exec): SIGTERM, SIGUSR1 or Ctrl-C
# to it reach the workers, which save and exit 75 (rerun the same command to resume); the workers
# die with it; it exits with dtrain's own code (0 done, 2 dtrain's errors, 3 non-finite, 75).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/entry_point.sh"  # MODULE, from the first argument
source "$ROOT/scripts/venv.sh"
NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count() or 4)')}"
REDIRECTS="0:0"  # torchrun's per-rank map: rank 0 inherits the terminal, the others go to files
for ((rank = 1; rank < NPROC; rank++)); do REDIRECTS+=",$rank:3"; done
exec python -m dtrain.launch --standalone --nproc_per_node="$NPROC" --log-dir="${LOG_DIR:-logs}" \
    --redirects="$REDIRECTS" -m "$MODULE" "$@"
