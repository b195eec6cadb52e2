import csv
import sys
from collections import defaultdict

totals = defaultdict(int)
with open("/app/sales.csv") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] += int(row["units"]) * int(row["unit_price"])
want = ["region,revenue"] + [
    f"{r},{v}" for r, v in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))
]
try:
    got = open("/app/revenue.csv").read().split()
except OSError as e:
    sys.exit(f"revenue.csv: {e}")
if got != want:
    sys.exit(f"revenue.csv is {got}, want {want}")
