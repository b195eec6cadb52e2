#!/bin/bash
set -euo pipefail
cd /app
[ -f shop.db ] || python3 build_db.py
python3 - <<'EOF'
import sqlite3
db = sqlite3.connect("/app/shop.db")
(name,) = db.execute(
    "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
    "JOIN order_items i ON i.order_id = o.id GROUP BY c.id "
    "ORDER BY SUM(i.quantity * i.price) DESC LIMIT 1"
).fetchone()
open("/app/answer.txt", "w").write(name + "\n")
EOF
