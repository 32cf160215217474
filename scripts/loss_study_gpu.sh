#!/usr/bin/env bash
# A resumable loss study (benchmarks.loss_compare, or STUDY=benchmarks.mapl_loopback) inside one time-limited GPU call.
#   BUDGET_S=540 bash scripts/loss_study_gpu.sh RESULTS_JSON [the study's flags]
# RESULTS_JSON: the study's json in the repository; its runs are kept and only the missing ones train. The
# updated json and report go to $OUT (the GPU machine's output folder), or back to RESULTS_JSON when $OUT is
# unset. BUDGET_S (default 540) stops the study in time: the runs that finished are in the json, the same command
# again trains the rest. megatron-core comes from the wheels in .whl/ when that folder exists (installed into
# /tmp/site), else from the Python that runs this. Every step line and the versions are logged to $OUT/LOG.
# It writes 3 files to $OUT (json, md, log); the device tool brings back at most 8, so a call holds at most two
# studies and 2 more files (a third study's or extra files are left there).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: BUDGET_S=540 bash scripts/loss_study_gpu.sh RESULTS_JSON [the study's flags]"; exit 2; }
results=$1
shift
study=${STUDY:-benchmarks.loss_compare}
case $study in benchmarks.loss_compare | benchmarks.mapl_loopback) ;; *) echo "STUDY=$study: expected benchmarks.loss_compare or benchmarks.mapl_loopback"; exit 2 ;; esac
out=${OUT:-$(dirname "$results")}
name=$(basename "$results" .json)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OMP_NUM_THREADS=1
# git's HEAD, marked "+ uncommitted changes" when tracked files differ from it: on the GPU machine the copied tree's
# HEAD can be stale, so write the sending checkout's commit into the call's command (PROJECT_COMMIT=abc1234 bash ...)
export PROJECT_COMMIT=${PROJECT_COMMIT:-$(python3 -c 'from benchmarks.provenance import project_commit; print(project_commit())')}
[ "$out/$name.json" -ef "$results" ] || { [ ! -f "$results" ] || cp "$results" "$out/$name.json"; }
log="$out/$name.log"
{
  echo "# $(date -u +%F' '%T) commit $PROJECT_COMMIT: STUDY=$study BUDGET_S=${BUDGET_S:-540} bash scripts/loss_study_gpu.sh $(printf '%q ' "$results" "$@")"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton, megatron.core; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', megatron.core.__version__)"
} >> "$log" 2>&1
set +e
timeout --signal=INT --kill-after=20 "${BUDGET_S:-540}" \
  python3 -m "$study" --json "$out/$name.json" "$@" 2>&1 | grep --line-buffered -v Warning | tee -a "$log"
status=${PIPESTATUS[0]}
set -e
echo "# $(date -u +%F' '%T) ${study#benchmarks.} exit $status ($([ "$status" = 124 ] && echo "stopped at BUDGET_S; the json keeps the finished runs" || echo done))" | tee -a "$log"
