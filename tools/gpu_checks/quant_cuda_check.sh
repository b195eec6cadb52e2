#!/usr/bin/env bash
# miles-quant on a GPU: build the CUDA kernels (native/quant/cuda) into the package and run the
# gpu-marked tests (CUDA kernels == the PyTorch reference, bit for bit, on every format).
#
# Why: the CPU machines only compile the CUDA code (tests/test_cuda.py); this is the check that
# runs it. One short script, < 5 minutes: a venv on top of the machine's CUDA torch, one build
# with -Ccmake.define.MILES_QUANT_CUDA=ON for the GPU's own architecture, the gpu tests.
#
# On a machine with a CUDA torch, nvcc, and PyPI (or the wheels below):
#     bash tools/gpu_checks/quant_cuda_check.sh
# On a machine without network: first, where the registries are reachable,
#     bash tools/gpu_checks/quant_cuda_check.sh --prepare      # wheels -> build/gpu-wheelhouse
# then carry build/gpu-wheelhouse to the GPU machine and run the script there.
# Without a GPU (nvcc only, as on the CPU machines), --build-only does the build and checks the
# CUDA module is there, then stops (installs torch==2.13.0 into the venv if it lacks one).
# Environment: PYTHON (default python3), MQ_WHEELHOUSE (default build/gpu-wheelhouse),
# MQ_CUDA_ARCH (default "native": the GPU in the machine; e.g. "90" or "90;100"), MQ_BENCH_JSON
# (when set, after the tests: tools/bench/quant_cuda_bandwidth.py on the same build, figures here).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELHOUSE=${MQ_WHEELHOUSE:-build/gpu-wheelhouse}
BUILD_REQS=("scikit-build-core>=0.10" "nanobind>=2.4" pathspec packaging)  # as pyproject.toml
TEST_REQS=(pytest hypothesis iniconfig pluggy sortedcontainers attrs)

if [[ "${1:-}" == "--prepare" ]]; then
  mkdir -p "$WHEELHOUSE"
  "$PY" -m pip download -q --only-binary=:all: -d "$WHEELHOUSE" "${BUILD_REQS[@]}" "${TEST_REQS[@]}" cmake ninja
  echo "wheels in $WHEELHOUSE: carry it to the GPU machine"
  exit 0
fi

BUILD_ONLY=0
[[ "${1:-}" == "--build-only" ]] && BUILD_ONLY=1
ARCH=${MQ_CUDA_ARCH:-$([[ $BUILD_ONLY == 1 ]] && echo "90;100" || echo native)}

start=$SECONDS
[[ $BUILD_ONLY == 1 ]] || "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  || { echo "quant_cuda_check: needs a CUDA build of torch and a GPU (PYTHON=$PY)"; exit 2; }
NVCC=$(command -v nvcc || true)
[[ -z "$NVCC" && -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]] && NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
[[ -n "$NVCC" ]] || { echo "quant_cuda_check: nvcc not found (PATH or CUDA_HOME)"; exit 2; }
export PATH="$(dirname "$NVCC"):$PATH"
nvcc --version | tail -1

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# A venv on top of the machine's Python where that keeps its torch visible. When $PY is itself a
# venv (the GPU image's python3 is /opt/torch/.venv), --system-site-packages would expose the
# base interpreter's packages, not $PY's torch: then a --target directory on PYTHONPATH instead,
# holding only what $PY lacks (pip --target reinstalls whatever it is asked for).
if "$PY" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)" \
  || ! "$PY" -m venv --system-site-packages "$TMP/venv" 2>/dev/null; then
  VPY=$PY
  export PYTHONPATH="$TMP/site${PYTHONPATH:+:$PYTHONPATH}"
  PIP_BASE=("$VPY" -m pip install -q --disable-pip-version-check --target "$TMP/site")
else
  VPY=$TMP/venv/bin/python
  PIP_BASE=("$VPY" -m pip install -q --disable-pip-version-check)
fi
PIP=("${PIP_BASE[@]}")
if [[ -d "$WHEELHOUSE" ]]; then
  PIP+=(--no-index --find-links "$WHEELHOUSE")
fi
# Ask pip only for what is missing or too old (an installed distribution satisfying the
# requirement is kept; in --target mode pip would reinstall it and need it in the wheelhouse).
have() {
  "$VPY" - "$1" 2>/dev/null <<'PY'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
r = Requirement(sys.argv[1])
sys.exit(0 if r.specifier.contains(md.version(r.name), prereleases=True) else 1)
PY
}
NEED=()
for req in "${BUILD_REQS[@]}" "${TEST_REQS[@]}"; do
  have "$req" || NEED+=("$req")
done
echo "python: $VPY; to install: ${NEED[*]:-nothing}"
[[ ${#NEED[@]} == 0 ]] || "${PIP[@]}" "${NEED[@]}"
command -v cmake >/dev/null || "${PIP[@]}" cmake ninja  # scikit-build-core would download them
if [[ $BUILD_ONLY == 1 ]] && ! "$VPY" -c "import torch" 2>/dev/null; then
  "${PIP_BASE[@]}" torch==2.13.0  # CPU machines: pip's config points at the local wheel
fi

echo "== build (MILES_QUANT_CUDA=ON, arch $ARCH)"
"${PIP[@]}" --no-deps --no-build-isolation \
  -Cbuild-dir="$TMP/build" \
  -Ccmake.define.MILES_QUANT_CUDA=ON \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" \
  packages/miles-quant
"$VPY" -c "from miles_quant import _native; assert _native.cuda_available(), _native.cuda_error(); print('CUDA kernels built; CPU isa', _native.isa())"
if [[ $BUILD_ONLY == 1 ]]; then
  echo "quant_cuda_check: built (no GPU tests with --build-only) in $((SECONDS - start)) s"
  exit 0
fi

echo "== gpu tests"
cd "$TMP"  # import the installed package, not the checkout's src/
timeout 240 "$VPY" -m pytest -q -p no:cacheprovider -m gpu \
  "$OLDPWD/packages/miles-quant/tests/test_cuda.py"
echo "quant_cuda_check: passed in $((SECONDS - start)) s"
if [[ -n "${MQ_BENCH_JSON:-}" ]]; then
  echo "== bandwidth (tools/bench/quant_cuda_bandwidth.py)"
  timeout 300 "$VPY" "$OLDPWD/tools/bench/quant_cuda_bandwidth.py" --json "$MQ_BENCH_JSON"
fi
