#!/usr/bin/env bash
# Train on this machine: all GPUs, or 4 CPU processes without one. Extra arguments are Hydra
# overrides, e.g.  ./launch/local.sh +experiment=llama3_tp4 train.max_steps=10
# Rank 0 keeps the terminal (its progress bar and lines; its log is also RUN_DIR/sft.log); every
# other rank writes to LOG_DIR/<run>/attempt_0/<rank>/{stdout,stderr}.log (LOG_DIR: logs/).
# Exits with dtrain's own code (0 done, 2 bad config, 3 non-finite, 75 preempted or Ctrl-C: rerun
# the same command to resume), which torchrun alone reports as 1: dtrain writes it to DTRAIN_EXIT_FILE.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count() or 4)')}"
EXTRA=()
if [ $((NPROC % 2)) -ne 0 ]; then EXTRA+=("parallel.tp=1"); fi  # the default tp=2 needs an even world
REDIRECTS="0:0"  # torchrun's per-rank map: rank 0 inherits the terminal, the others go to files
for ((rank = 1; rank < NPROC; rank++)); do REDIRECTS+=",$rank:3"; done
DTRAIN_EXIT_FILE="$(mktemp -t dtrain-exit.XXXXXX)"
export DTRAIN_EXIT_FILE
trap 'rm -f "$DTRAIN_EXIT_FILE"' EXIT
# SIGTERM or Ctrl-C to this script's process group reach torchrun too, which forwards them to the
# workers (they save and exit 75): wait for it rather than exit now with the signal's own code.
trap ':' TERM INT
status=0
torchrun --standalone --nproc_per_node="$NPROC" --log-dir="${LOG_DIR:-logs}" --redirects="$REDIRECTS" \
    -m dtrain.sft "${EXTRA[@]}" "$@" || status=$?
if [ "$status" -ne 0 ] && [ -s "$DTRAIN_EXIT_FILE" ]; then status="$(cat "$DTRAIN_EXIT_FILE")"; fi
exit "$status"
