#!/usr/bin/env bash
# Set up the environment and train the tiny GPT with TP=2 + SP on 2 ranks (CPU/gloo without a GPU).
#   bash scripts/run_demo.sh [extra trainer flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv "${MCORE_VERSION:-0.19.2}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=ignore
PYTHON=.venv/bin/python exec bash scripts/run.sh configs/gpt-tiny.yaml "$@"
