# Sourced by the launch scripts (local.sh, slurm.sbatch), with ROOT the repository: the entry point
# to run, MODULE (dtrain.sft unless the first argument names another), and that argument shifted off;
# the arguments left are Hydra's. An entry point is an objective's (docs/extending.md): dtrain/NAME.py
# beside dtrain/objectives/NAME.py, e.g. `./launch/local.sh dpo optim.lr=1e-6` runs dtrain.dpo.
MODULE=dtrain.sft
if [[ $# -gt 0 && $1 =~ ^[a-z][a-z0-9_]*$ ]]; then
  if [[ ! -f "$ROOT/dtrain/$1.py" || ! -f "$ROOT/dtrain/objectives/$1.py" ]]; then
    entries=()
    for path in "$ROOT"/dtrain/objectives/[a-z]*.py; do
      name="$(basename "$path" .py)"
      if [[ -f "$ROOT/dtrain/$name.py" ]]; then entries+=("$name"); fi
    done
    list="${entries[*]}"
    echo "dtrain: error: $1 is not an entry point: the first argument, if not an override (KEY=VALUE)," \
      "is one of ${list// /, }" >&2
    exit 2
  fi
  MODULE="dtrain.$1"
  shift
fi
