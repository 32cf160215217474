#!/usr/bin/env bash
# Acceptance on real Megatron-LM (GPU machine, 2 GPUs; --suite four-gpu: 4): its pretrain_gpt.py with --mock-data through
# the launcher and through the patch, TP=2 + SP, local and Transformer Engine layers, bf16 and TE FP8,
# TACO none / fp8 / fp8-ash / int8 / 4-bit, socket and NVLink regimes (suites: --list). Writes benchmarks/results/megatron_lm.{md,json}.
#   bash scripts/megatron_lm_check.sh MEGATRON_LM_DIR [--megatron-lm-016 DIR] [--rows A,B | --suite smoke] [--list]
# Needs torch with CUDA, Megatron-LM's Python dependencies (README) and, for the TE rows, Transformer Engine.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=${1:?usage: scripts/megatron_lm_check.sh MEGATRON_LM_DIR [benchmarks/megatron_lm_check.py flags]}
shift
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$here/benchmarks/megatron_lm_check.py" --megatron-lm "$dir" "$@"
