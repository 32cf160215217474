#!/usr/bin/env bash
# Create (or reuse) a virtual environment with megatron_taco and a chosen megatron-core.
#   bash scripts/setup_env.sh [VENV_DIR] [MEGATRON_CORE_VERSION]
# Installs the pinned CPU torch first when there is no GPU (an unpinned torch pulls a
# multi-GB CUDA build). megatron-core 0.17+ declares Python >= 3.12 but its cp311
# wheels work: they are installed with --no-deps --ignore-requires-python.
# pip runs only when the inputs changed (pyproject.toml, this script, the megatron-core
# version: their hash is stamped into the environment) or the environment is broken.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
mcore=${2:-0.19.2}
case $venv in /*) ;; *) venv=$PWD/$venv ;; esac
stamp="$venv/.setup-inputs.sha256"
inputs_hash=$(python3 -c 'import hashlib, sys; print(hashlib.sha256(sys.argv[1].encode() + b"".join(open(p, "rb").read() for p in sys.argv[2:])).hexdigest())' \
  "$mcore" pyproject.toml scripts/setup_env.sh)
# Imports from outside the repository, so that megatron_taco is the installed one.
report="import megatron.core, torch, triton, megatron_taco, sys; print(*sys.argv[1:], 'megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs_hash" ] && (cd / && "$venv/bin/python" -c "$report" "env ready (cached):" "$venv") 2>/dev/null; then
  exit 0
fi
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  # TORCH_INDEX_URL: where the CPU torch comes from (e.g. https://download.pytorch.org/whl/cpu where only PyPI,
  # whose Linux torch is the CUDA build, is reachable otherwise)
  if command -v nvidia-smi >/dev/null 2>&1; then "${pip[@]}" install "torch>=2.6"
  else "${pip[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0; fi
fi
"${pip[@]}" install triton numpy pyyaml "packaging>=24.2" "pytest>=8" matplotlib ruff==0.17.6 tokenizers
case "$mcore" in
  0.16.*) "${pip[@]}" install "megatron-core==$mcore" ;;
  *) "${pip[@]}" install --no-deps --ignore-requires-python "megatron-core==$mcore" ;;
esac
"${pip[@]}" install --no-deps -e .
(cd / && "$venv/bin/python" -c "$report" "env ready:" "$venv")
echo "$inputs_hash" > "$stamp"
