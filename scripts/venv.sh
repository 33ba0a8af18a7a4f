#!/usr/bin/env bash
# Make .venv (once) and install dtrain into it. Sourced by the other scripts.
# A torch already visible to python3 (your own CUDA build) is kept: the venv sees system
# site-packages. Without one, the CPU build torch==2.13.0 is installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DTRAIN_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] no torch found: installing torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi
STAMP="$VENV/.dtrain-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "[setup] installing dtrain and its dependencies into $VENV"
  "$PY" -m pip install -q -e "$ROOT[dev]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
