#!/usr/bin/env bash
# GPU smoke run: the tiny GPT with TP=2 + SP on 2 GPUs over NCCL, bf16.
#   bash scripts/gpu_smoke.sh [extra trainer flags]
# Needs torch with CUDA, megatron-core and megatron_taco importable (PYTHONPATH or pip install -e .).
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONWARNINGS=ignore
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, megatron.core, triton; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())"
exec python3 -m torch.distributed.run --nproc-per-node 2 examples/pretrain_gpt.py \
  --config configs/gpt-tiny.yaml --dtype bf16 --train-iters 30 "$@"
