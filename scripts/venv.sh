#!/usr/bin/env bash
# Make .venv (once) and install dtrain into it. Sourced by the other scripts.
# A torch already visible to python3 (your own CUDA build) is kept: only then does the venv see
# system site-packages. Without one the venv is plain (the system's other packages, pytest plugins
# included, stay out of the project's pytest) and the CPU build torch==2.13.0 is installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DTRAIN_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  if python3 -c "import torch" 2>/dev/null; then
    echo "[setup] creating $VENV (keeping python3's own torch: $(python3 -c 'import torch; print(torch.__version__)'))"
    python3 -m venv --system-site-packages "$VENV"
    # A python3 of a virtual environment (where that torch is) makes a venv that sees its base
    # interpreter's site-packages, not the environment's: point the new venv at those too.
    python3 -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dtrain-outer-env.pth"
  else
    echo "[setup] creating $VENV"
    python3 -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
BITSANDBYTES=0.50.2  # tests only: dtrain's NF4 (lora.base_dtype=nf4) is its own torch code
# The installs skip pip's byte-compilation (a file at a time) for one compileall on every core
# after them: 49 s of set-up instead of 59 s on 2 cores. Files this Python cannot compile (torch's
# Python 3.12 test helpers) are skipped, as pip skips them.
# Compiling lazily instead (at first import) is no saving: where PYTHONDONTWRITEBYTECODE is set (it
# is on the machines this project is developed on), nothing is kept and every process compiles its
# imports again (17.8 s of CPU to import dtrain.sft instead of 7.4).
PIP_INSTALL=("$PY" -m pip install -q --no-compile)
INSTALLED=
compile_installed() {
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    > /dev/null || true
}
# Whether torch is installed, without importing it (a second and a half of every launch's start).
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  echo "[setup] no torch found: installing torch==2.13.0"
  "${PIP_INSTALL[@]}" torch==2.13.0
  INSTALLED=1
fi
STAMP="$VENV/.dtrain-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "${BASH_SOURCE[0]}" -nt "$STAMP" ]; then
  echo "[setup] installing dtrain and its dependencies into $VENV"
  "${PIP_INSTALL[@]}" -e "$ROOT[dev]"
  # QLoRA's reference (tests/test_qlora.py): its own requirements are torch, numpy and packaging,
  # all here already; --no-deps so that no resolver ever swaps the torch build installed above
  "${PIP_INSTALL[@]}" --no-deps "bitsandbytes==$BITSANDBYTES"
  INSTALLED=1
  touch "$STAMP"
fi
if [ -n "${INSTALLED:-}" ]; then compile_installed; fi
export PATH="$VENV/bin:$PATH"
