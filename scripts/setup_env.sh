#!/usr/bin/env bash
# Create (or reuse) a virtual environment with megatron_taco and a chosen megatron-core.
#   bash scripts/setup_env.sh [VENV_DIR] [MEGATRON_CORE_VERSION]
# Installs the pinned CPU torch first when there is no GPU (an unpinned torch pulls a
# multi-GB CUDA build). megatron-core 0.17+ declares Python >= 3.12 but its cp311
# wheels work: they are installed with --no-deps --ignore-requires-python.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
mcore=${2:-0.19.2}
python3 -m venv "$venv"
pip="$venv/bin/python -m pip -q --disable-pip-version-check"
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then $pip install "torch>=2.6"; else $pip install torch==2.13.0; fi
fi
$pip install triton numpy pyyaml "packaging>=24.2" "pytest>=8" matplotlib
case "$mcore" in
  0.16.*) $pip install "megatron-core==$mcore" ;;
  *) $pip install --no-deps --ignore-requires-python "megatron-core==$mcore" ;;
esac
$pip install --no-deps -e .
"$venv/bin/python" -c "import megatron.core, torch, triton, megatron_taco; print('env ready:', '$venv', 'megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
