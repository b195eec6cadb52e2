#!/bin/bash
set -euo pipefail
cd /app/src
sed -i -e 's/\bfetch_usr(/fetch_user(/g' -e 's/import fetch_usr$/import fetch_user/' main.py users/api.py
python3 main.py
