#!/usr/bin/env bash
# `miles train --ray` on one GPU: Ray places an SGLang engine (behind sglang-router) and a
# trainer rank (FSDP2, then Megatron) on the same GPU, half each; weights verified after every
# step; Ctrl-C leaves no SGLang process. Each step prints PASS or FAIL
# (tools/gpu_checks/ray_check.py says what each checks). Not run yet: no GPU in this project's
# sessions so far.
#
# Why: the CPU machines run --ray with gloo ranks and embedded engines only. < 9 minutes (a tiny
# random model built on the spot, CUDA graphs off; nothing is downloaded).
#
# On a machine whose Python has SGLang, a CUDA torch and Ray (pip install 'miles[ray]'):
#     bash tools/gpu_checks/ray_check.sh [--skip-megatron]
# sglang-router as for sglang_fleet_check.sh ($MILES_SGLANG_ROUTER, PATH, or next to Python).
# Without a GPU (what the CPU machines run to keep this script working):
#     bash tools/gpu_checks/ray_check.sh --dry-run-cpu
# Environment: PYTHON (default python3), TIMEOUT_S (default 540).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

DRY=0
for a in "$@"; do [[ "$a" == "--dry-run-cpu" ]] && DRY=1; done
if [[ $DRY == 0 ]]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    || { echo "FAIL setup: needs a CUDA torch and a GPU (PYTHON=$PY)"; exit 2; }
  "$PY" -c "import sglang; print('sglang', sglang.__version__)" \
    || { echo "FAIL setup: SGLang is not importable by $PY (pip install 'miles-rollout[sglang]')"; exit 2; }
fi
"$PY" -c "import ray; print('ray', ray.__version__)" \
  || { echo "FAIL setup: Ray is not importable by $PY (pip install 'miles[ray]')"; exit 2; }

# The packages from this checkout, without installing them.
export PYTHONPATH="packages/miles/src:packages/miles-rollout/src:packages/miles-trainer/src:packages/miles-transfer/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
timeout "${TIMEOUT_S:-540}" "$PY" tools/gpu_checks/ray_check.py "$@"
rc=$?
[[ $rc == 124 ]] && echo "FAIL timeout: the check ran past ${TIMEOUT_S:-540}s"
exit $rc
