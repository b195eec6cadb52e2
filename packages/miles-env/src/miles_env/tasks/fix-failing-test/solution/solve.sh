#!/bin/bash
set -euo pipefail
cd /app
sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/ 2/' stats.py
python3 -m unittest -q
