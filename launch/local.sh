#!/usr/bin/env bash
# Train on this machine: all GPUs, or 4 CPU processes without one. Extra arguments are Hydra
# overrides, e.g.  ./launch/local.sh +experiment=llama3_tp4 train.max_steps=10
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count() or 4)')}"
EXTRA=()
if [ $((NPROC % 2)) -ne 0 ]; then EXTRA+=("parallel.tp=1"); fi  # the default tp=2 needs an even world
exec torchrun --standalone --nproc_per_node="$NPROC" -m dtrain.sft "${EXTRA[@]}" "$@"
