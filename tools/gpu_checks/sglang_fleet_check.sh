#!/usr/bin/env bash
# miles-rollout fleet with SGLang engines on a GPU: a fleet of 1 behind sglang-router, a routed
# generate pair, a TITO session, update_weights_from_disk, the session again, a clean stop.
# Each step prints PASS or FAIL (tools/gpu_checks/sglang_fleet_check.py says what each checks).
#
# Why: the CPU machines run the fleet with the embedded engine and only build SGLang's command
# lines; this is the check that starts `python -m sglang.launch_server` for real. < 8 minutes
# (a tiny random model built on the spot, CUDA graphs off; nothing is downloaded).
#
# On a machine whose Python has SGLang (and a CUDA torch):
#     bash tools/gpu_checks/sglang_fleet_check.sh [--engines N] [--model-path DIR]
# sglang-router comes from that Python, PATH, $MILES_SGLANG_ROUTER, or a wheel in
# $WHEELHOUSE (default build/gpu-wheelhouse): where PyPI is reachable,
#     bash tools/gpu_checks/sglang_fleet_check.sh --prepare     # sglang-router wheel -> there
# then carry build/gpu-wheelhouse along. Without a GPU:
#     bash tools/gpu_checks/sglang_fleet_check.sh --dry-run-cpu  # same steps, embedded engine
# Environment: PYTHON (default python3), WHEELHOUSE, TIMEOUT_S (default 480).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-build/gpu-wheelhouse}
ROUTER_REQ="sglang-router==0.3.2"

if [[ "${1:-}" == "--prepare" ]]; then
  mkdir -p "$WHEELHOUSE"
  "$PY" -m pip download -q --only-binary=:all: --no-deps -d "$WHEELHOUSE" "$ROUTER_REQ"
  echo "wheels in $WHEELHOUSE: carry it to the GPU machine"
  exit 0
fi

DRY=0
for a in "$@"; do [[ "$a" == "--dry-run-cpu" ]] && DRY=1; done
if [[ $DRY == 0 ]]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    || { echo "FAIL setup: needs a CUDA torch and a GPU (PYTHON=$PY)"; exit 2; }
  "$PY" -c "import sglang; print('sglang', sglang.__version__)" \
    || { echo "FAIL setup: SGLang is not importable by $PY (pip install 'miles-rollout[sglang]')"; exit 2; }
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
BIN_DIR=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
if [[ -z "${MILES_SGLANG_ROUTER:-}" && ! -x "$BIN_DIR/sglang-router" ]] && ! command -v sglang-router >/dev/null; then
  # Only the router, into a private directory: the machine's packages stay as they are.
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$TMP/router" \
    --no-index --find-links "$WHEELHOUSE" "$ROUTER_REQ" 2>/dev/null \
    || "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$TMP/router" "$ROUTER_REQ" \
    || { echo "FAIL setup: no sglang-router (run --prepare where PyPI is reachable)"; exit 2; }
  export PYTHONPATH="$TMP/router${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$TMP/router/bin:$PATH"
fi

# The packages from this checkout, without installing them (their dependencies are SGLang's).
export PYTHONPATH="packages/miles-rollout/src:packages/miles-transfer/src${PYTHONPATH:+:$PYTHONPATH}"
timeout "${TIMEOUT_S:-480}" "$PY" tools/gpu_checks/sglang_fleet_check.py "$@"
rc=$?
[[ $rc == 124 ]] && echo "FAIL timeout: the check ran past ${TIMEOUT_S:-480}s"
exit $rc
