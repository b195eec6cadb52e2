#!/bin/bash
set -euo pipefail
cd /app
for f in inbox/*; do
  name=$(basename "$f")
  case "$name" in
    *.*) ext=$(printf '%s' "${name##*.}" | tr 'A-Z' 'a-z') ;;
    *) ext=other ;;
  esac
  mkdir -p "sorted/$ext"
  mv "$f" "sorted/$ext/"
done
