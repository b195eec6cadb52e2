#!/usr/bin/env bash
# miles-trainer's R3 routing replay and checkpoint/resume on one GPU, FSDP2 (one rank) and
# Megatron (TP 1), fp32 and bf16: replay uses the rollout's experts and shrinks the logprob gap;
# stop, save, load, continue is bit-exact with trainer.deterministic; export_hf equals
# save_hf_checkpoint. Each step prints PASS or FAIL (tools/gpu_checks/trainer_r3_resume_check.py
# says what each checks). About a minute.
#
# Why: the CPU tests run both features on gloo; this runs the CUDA path (deterministic kernels,
# the MoE experts' CUDA index_add_, megatron's routing on CUDA, DCP from an NCCL group).
#
# On a machine whose Python has a CUDA torch:
#     bash tools/gpu_checks/trainer_r3_resume_check.sh
# megatron-core (and transformers, if missing) come from that Python or from wheels in
# $WHEELHOUSE (default build/gpu-wheelhouse): where PyPI is reachable,
#     bash tools/gpu_checks/trainer_r3_resume_check.sh --prepare   # wheels -> build/gpu-wheelhouse
# then carry build/gpu-wheelhouse along. Without a GPU, the same steps on the CPU path:
#     bash tools/gpu_checks/trainer_r3_resume_check.sh --cpu
# Environment: PYTHON (default python3), WHEELHOUSE, TIMEOUT_S (default 300).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-build/gpu-wheelhouse}
# No dependencies resolved: torch is the machine's own. transformers' own pure-Python needs.
REQS=("megatron-core==0.16.1" "transformers==5.24.0" "tokenizers" "safetensors" "huggingface-hub" "regex" "tqdm" "pyyaml" "filelock" "numpy" "packaging")

if [[ "${1:-}" == "--prepare" ]]; then
  mkdir -p "$WHEELHOUSE"
  "$PY" -m pip download -q --only-binary=:all: --no-deps -d "$WHEELHOUSE" "${REQS[@]}"
  echo "wheels in $WHEELHOUSE: carry it to the GPU machine"
  exit 0
fi

if [[ "${1:-}" != "--cpu" ]]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    || { echo "FAIL setup: needs a CUDA torch and a GPU (PYTHON=$PY); --cpu runs the CPU path"; exit 2; }
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
missing=()
for mod_req in "megatron.core:megatron-core==0.16.1" "transformers:transformers==5.24.0"; do
  "$PY" -c "import ${mod_req%%:*}" 2>/dev/null || missing+=("${mod_req#*:}")
done
if (( ${#missing[@]} )); then
  # Into a private directory, from the wheelhouse: the machine's packages stay as they are.
  "$PY" -m pip install -q --disable-pip-version-check --target "$TMP/site" --no-index \
    --find-links "$WHEELHOUSE" --no-deps "${missing[@]}" \
    || { echo "FAIL setup: cannot install ${missing[*]} (run --prepare where PyPI is reachable)"; exit 2; }
  for extra in tokenizers safetensors huggingface_hub regex tqdm yaml filelock; do
    "$PY" -c "import $extra" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check \
      --target "$TMP/site" --no-index --find-links "$WHEELHOUSE" --no-deps \
      "$(echo "$extra" | sed 's/_/-/; s/^yaml$/pyyaml/')" || true
  done
  export PYTHONPATH="$TMP/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# miles-trainer from this checkout, without installing it.
export PYTHONPATH="packages/miles-trainer/src${PYTHONPATH:+:$PYTHONPATH}"
timeout "${TIMEOUT_S:-300}" "$PY" tools/gpu_checks/trainer_r3_resume_check.py "$@"
rc=$?
[[ $rc == 124 ]] && echo "FAIL timeout: the check ran past ${TIMEOUT_S:-300}s"
exit $rc
