#!/usr/bin/env bash
# Set up one environment per supported megatron-core release and run the test suite in each.
#   bash scripts/run_tests.sh            # megatron-core 0.16.1 and 0.19.2
#   MCORE_VERSIONS=0.19.2 bash scripts/run_tests.sh -k codec
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 TRITON_INTERPRET=1 PYTHONWARNINGS=ignore
status=0
for version in ${MCORE_VERSIONS:-0.16.1 0.19.2}; do
  venv=".venv-mcore-$version"
  bash scripts/setup_env.sh "$venv" "$version"
  echo "=== tests with megatron-core $version ==="
  # pytest exits 5 when it collected no test: that is a failure here, like any other non-zero code.
  "$venv/bin/python" -m pytest -q "$@" tests || { echo "FAILED with megatron-core $version (exit $?)"; status=1; }
done
exit $status
