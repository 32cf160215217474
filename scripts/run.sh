#!/usr/bin/env bash
# Launch the self-contained trainer with a config from configs/ (flags after the config override it).
#   bash scripts/run.sh configs/gpt-tiny.yaml [--train-iters 50 --taco-mode fp8 ...]
# Ranks: NPROC (default: TP x PP from the config, at least 1); other torchrun settings via TORCHRUN_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: scripts/run.sh CONFIG.yaml [trainer flags]}
shift
python=${PYTHON:-python3}
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$python" - "$config" <<'PY'
import sys, yaml
training = (yaml.safe_load(open(sys.argv[1])) or {}).get("training", {}) or {}
print(max(1, int(training.get("tensor_model_parallel_size", 1)) * int(training.get("pipeline_model_parallel_size", 1))))
PY
)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec "$python" -m torch.distributed.run --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} \
  examples/pretrain_gpt.py --config "$config" "$@"
