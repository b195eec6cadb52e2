#!/usr/bin/env bash
# The colocated GPU update path on one GPU: CUDA IPC payloads of CUDA tensors
# (miles_transfer.push.serialize_cuda_ipc, what ColocatedReceiver sends to an SGLang engine on
# the trainer's GPUs), checked with cuda-python in the sender, then opened in a second process by
# raw handle (cuda-python) and as SGLang does (torch's rebuild, device by UUID); every tensor bit
# for bit, with figures against torch's own device-to-host copy. Each step prints PASS or FAIL
# (tools/gpu_checks/transfer_cuda_ipc_check.py says what each checks). Under a minute.
# Not run yet: this project's sessions had no GPU.
#
#     bash tools/gpu_checks/transfer_cuda_ipc_check.sh [--mib 256]
#     bash tools/gpu_checks/transfer_cuda_ipc_check.sh --dry-run-cpu   # no GPU: the same steps
#                                                                     # through shared memory
# Needs: a CUDA torch in $PYTHON (default python3) and cuda-python
# (pip install 'miles-transfer[cuda]'; on a CUDA 12 driver 'cuda-python>=12.8,<13').
# Environment: PYTHON, TIMEOUT_S (default 180).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

if [[ " $* " != *" --dry-run-cpu "* ]]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    || { echo "FAIL setup: needs a CUDA torch and a GPU (PYTHON=$PY); --dry-run-cpu runs without one"; exit 2; }
  "$PY" -c "from cuda.bindings import runtime" \
    || { echo "FAIL setup: cuda-python is not importable: pip install 'miles-transfer[cuda]'"; exit 2; }
fi

# miles-transfer from this checkout, without installing it.
export PYTHONPATH="packages/miles-transfer/src${PYTHONPATH:+:$PYTHONPATH}"
timeout "${TIMEOUT_S:-180}" "$PY" tools/gpu_checks/transfer_cuda_ipc_check.py "$@"
rc=$?
[[ $rc == 124 ]] && echo "FAIL timeout: the check ran past ${TIMEOUT_S:-180}s"
exit $rc
