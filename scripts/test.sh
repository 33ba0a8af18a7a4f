#!/usr/bin/env bash
# The test command (README and .ci/run): lint, then the whole suite on CPU, in two pytest workers
# (pytest-xdist, a test file per worker at a time: its module fixtures run once). Most tests wait on
# launched processes' imports and collectives; two workers keep both cores of a CI machine busy.
# Files start longest first (tests/conftest.py's LONGEST_FIRST; --no-loadscope-reorder keeps that
# order instead of xdist's, by number of tests). DTRAIN_TEST_WORKERS=0 runs everything in this
# process. pytest's exit status is the script's: a selection that runs no test (5) fails like a
# failing test does.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
ruff check .
python -m pytest -n "${DTRAIN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
