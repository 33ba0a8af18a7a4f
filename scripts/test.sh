#!/usr/bin/env bash
# The test command (README and .ci/run): lint, then the whole suite on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
ruff check .
python -m pytest "$@"
