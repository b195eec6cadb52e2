#!/bin/bash
# Install the agent frameworks miles-env integrates with, each in its own virtual environment
# (they pin other versions of openai / mcp / pydantic than Miles, and NeMo Gym and Harbor need
# Python 3.12), under ${MILES_CACHE_DIR:-~/.cache/miles}/frameworks/<name>. The integration
# tests (packages/miles-env/tests/test_integrations.py) run each framework's server with that
# Python and skip, naming this script, where it is missing. PyPI only; about 3 GB in all.
#
#   bash tools/setup_agent_frameworks.sh                 # all of them
#   bash tools/setup_agent_frameworks.sh openenv nemo-gym
set -euo pipefail
root="${MILES_CACHE_DIR:-$HOME/.cache/miles}/frameworks"
mkdir -p "$root"
declare -A spec=(
  [openenv]="3.11|openenv==0.10.0"
  [nemo-gym]="3.12|nemo-gym==0.4.0"
  [verifiers]="3.11|verifiers==0.4.0"
  [hud]="3.11|hud"
  [harbor]="3.12|harbor"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(openenv nemo-gym verifiers hud harbor)
for name in "${names[@]}"; do
  [ -n "${spec[$name]:-}" ] || { echo "unknown framework $name (one of ${!spec[*]})" >&2; exit 2; }
  py="${spec[$name]%%|*}"; req="${spec[$name]#*|}"
  dir="$root/$name"
  # Harbor's podman environment drives podman through podman-compose (podman 4.3 has no
  # `podman compose`): miles_env.integrations.harbor.
  if [ "$name" = harbor ] && [ -x "$dir/bin/pip" ] && [ ! -x "$dir/bin/podman-compose" ]; then
    "$dir/bin/pip" install -q podman-compose
  fi
  if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "${req%%=*}" 2>/dev/null; then
    echo "$name: ready ($dir)"; continue
  fi
  interp=""
  if "python$py" -c "" 2>/dev/null; then
    interp="python$py"
  elif v="$(pyenv versions --bare 2>/dev/null | grep "^$py" | tail -1)" && [ -n "$v" ]; then
    interp="$(pyenv root)/versions/$v/bin/python$py"   # pyenv: e.g. 3.12.1
  fi
  [ -n "$interp" ] || { echo "$name needs Python $py (apt, pyenv, ...)" >&2; exit 1; }
  echo "$name: installing $req with $interp into $dir"
  rm -rf "$dir"
  "$interp" -m venv "$dir"
  "$dir/bin/pip" install -q "$req"
  [ "$name" != harbor ] || "$dir/bin/pip" install -q podman-compose
done
