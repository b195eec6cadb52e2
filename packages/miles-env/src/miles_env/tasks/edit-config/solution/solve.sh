#!/bin/bash
set -euo pipefail
cd /app/config
sed -i -e 's/^port = 8000$/port = 8080/' -e 's/^debug = true$/debug = false/' service.ini
printf '\n[cache]\nbackend = redis\nttl_seconds = 300\n' >> service.ini
