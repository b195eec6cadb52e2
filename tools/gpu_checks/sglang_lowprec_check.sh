#!/usr/bin/env bash
# SGLang serving the low-precision formats with the flags Miles' fleet sets (fp8_block128,
# mxfp8 online; nvfp4, int4_g128 from miles-quant exports), compared with the embedded engine.
# Each step prints PASS or FAIL (tools/gpu_checks/sglang_lowprec_check.py says what it checks).
# < 10 minutes; a tiny random model built on the spot, nothing downloaded.
#
# On a machine whose Python has SGLang (and a CUDA torch), from the repository root:
#     bash tools/gpu_checks/sglang_lowprec_check.sh
# Without a GPU (builds the model, the exports and the command lines only):
#     bash tools/gpu_checks/sglang_lowprec_check.sh --dry-run-cpu
# Environment: PYTHON (default python3), TIMEOUT_S (default 600).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DRY=0
for a in "$@"; do [[ "$a" == "--dry-run-cpu" ]] && DRY=1; done
if [[ $DRY == 0 ]]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" \
    || { echo "FAIL setup: needs a CUDA torch and a GPU (PYTHON=$PY)"; exit 2; }
  "$PY" -c "import sglang" \
    || { echo "FAIL setup: SGLang is not importable by $PY (pip install 'miles-rollout[sglang]')"; exit 2; }
fi
# The packages from this checkout, without installing them.
export PYTHONPATH="packages/miles-rollout/src:packages/miles-transfer/src:packages/miles-quant/src${PYTHONPATH:+:$PYTHONPATH}"
timeout "${TIMEOUT_S:-600}" "$PY" tools/gpu_checks/sglang_lowprec_check.py "$@"
rc=$?
[[ $rc == 124 ]] && echo "FAIL timeout: the check ran past ${TIMEOUT_S:-600}s"
exit $rc
