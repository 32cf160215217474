#!/usr/bin/env bash
# Launch the self-contained trainer with a config (flags after the config override it), from any folder.
#   bash scripts/run.sh configs/gpt-tiny.yaml [--train-iters 50 --taco-mode fp8 --save ./ckpt ...]
#   bash scripts/run.sh --help     # the trainer's flags
# Relative paths (the config, --save, --load, --data, --tensorboard-dir) are read from the folder you run it
# in; a config that is not there is taken from the repository (configs/gpt-tiny.yaml works from anywhere).
# Python: $PYTHON, else the repository's .venv or .venv-mcore-0.19.2 (scripts/setup_env.sh, scripts/run_demo.sh).
# Ranks: NPROC (default: TP x PP from the config, at least 1); other torchrun settings via TORCHRUN_ARGS.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-}
for venv in .venv .venv-mcore-0.19.2; do
  if [ -z "$python" ] && [ -x "$repo/$venv/bin/python" ]; then python=$repo/$venv/bin/python; fi
done
if [ -z "$python" ]; then
  echo "error: no Python environment in $repo (.venv or .venv-mcore-0.19.2): run 'bash $repo/scripts/run_demo.sh' or 'bash $repo/scripts/setup_env.sh' first, or set PYTHON" >&2
  exit 1
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's megatron_taco, whichever environment runs it
config=${1:?usage: scripts/run.sh CONFIG.yaml [trainer flags]}
shift
case $config in -h|--help) exec "$python" "$repo/examples/pretrain_gpt.py" --help ;; esac
if [ ! -e "$config" ] && [ -e "$repo/$config" ]; then config=$repo/$config; fi
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$python" - "$config" <<'PY'
import sys, yaml
try:
    training = (yaml.safe_load(open(sys.argv[1])) or {}).get("training", {}) or {}
    print(max(1, int(training.get("tensor_model_parallel_size", 1)) * int(training.get("pipeline_model_parallel_size", 1))))
except Exception:  # an unreadable config: one rank, and the trainer says what is wrong with it
    print(1)
PY
)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec "$python" -m megatron_taco.training.quiet_torchrun --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} \
  "$repo/examples/pretrain_gpt.py" --config "$config" "$@"
