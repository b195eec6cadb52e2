#!/usr/bin/env bash
# Make .venv-bench: TRL in its own virtual environment, so the peer of tools/bench/trl_vs_miles.py
# cannot change what miles' own .venv resolves. Idempotent; about a minute from the registry.
#
#   tools/bench/setup_trl_venv.sh            # then: .venv/bin/python tools/bench/trl_vs_miles.py
#
# torch goes first and pinned (the local CPU wheel; a bare `torch` pulls a multi-GB CUDA build),
# then TRL with the repo's constraints (transformers==5.24.0, the version miles is tested with).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
VENV=${VENV:-.venv-bench}
TRL_VERSION=${TRL_VERSION:-1.16.0}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q -c constraints.txt torch==2.13.0
"$VENV/bin/pip" install -q -c constraints.txt "trl==$TRL_VERSION" accelerate datasets
"$VENV/bin/python" -c "import torch, transformers, trl; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__)"
