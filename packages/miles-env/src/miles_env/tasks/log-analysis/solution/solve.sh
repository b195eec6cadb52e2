#!/bin/bash
set -euo pipefail
cd /app
awk '$9 ~ /^5/ { print $1 }' access.log | sort -u | wc -l > answer.txt
awk '{ print $7 }' access.log | sort | uniq -c | sort -k1,1nr | head -1 | awk '{ print $2 }' >> answer.txt
