#!/usr/bin/env bash
# Train on this machine: all GPUs, or 4 CPU processes without one. Extra arguments are Hydra
# overrides, e.g.  ./launch/local.sh +experiment=llama3_tp4 train.max_steps=10
# Rank 0 keeps the terminal (its progress bar and lines; its log is also RUN_DIR/sft.log); every
# other rank writes to LOG_DIR/<run>/attempt_0/<rank>/{stdout,stderr}.log (LOG_DIR: logs/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count() or 4)')}"
EXTRA=()
if [ $((NPROC % 2)) -ne 0 ]; then EXTRA+=("parallel.tp=1"); fi  # the default tp=2 needs an even world
REDIRECTS="0:0"  # torchrun's per-rank map: rank 0 inherits the terminal, the others go to files
for ((rank = 1; rank < NPROC; rank++)); do REDIRECTS+=",$rank:3"; done
exec torchrun --standalone --nproc_per_node="$NPROC" --log-dir="${LOG_DIR:-logs}" --redirects="$REDIRECTS" \
    -m dtrain.sft "${EXTRA[@]}" "$@"
