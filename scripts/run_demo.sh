#!/usr/bin/env bash
# Set up the environment and train the tiny GPT with TP=2 + SP on 2 ranks (CPU/gloo without a GPU), from any folder.
#   bash scripts/run_demo.sh [extra trainer flags]
# The environment is the one the tests use (.venv-mcore-0.19.2, made by scripts/setup_env.sh; reused once made).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
mcore=${MCORE_VERSION:-0.19.2}
bash "$repo/scripts/setup_env.sh" ".venv-mcore-$mcore" "$mcore"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=ignore
PYTHON="$repo/.venv-mcore-$mcore/bin/python" exec bash "$repo/scripts/run.sh" "$repo/configs/gpt-tiny.yaml" "$@"
