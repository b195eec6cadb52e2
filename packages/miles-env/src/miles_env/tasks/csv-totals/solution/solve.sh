#!/bin/bash
set -euo pipefail
cd /app
{ echo region,revenue
  tail -n +2 sales.csv | awk -F, '{ r[$1] += $3 * $4 } END { for (k in r) print k "," r[k] }' \
    | sort -t, -k2,2nr -k1,1
} > revenue.csv
