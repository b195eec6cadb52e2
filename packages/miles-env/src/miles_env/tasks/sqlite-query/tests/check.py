import os
import sqlite3
import subprocess
import sys
import tempfile

tmp = tempfile.mkdtemp()
script = open("/app/build_db.py").read().replace("/app/shop.db", f"{tmp}/shop.db")
subprocess.run([sys.executable, "-c", script], check=True)
db = sqlite3.connect(f"{tmp}/shop.db")
(want,) = db.execute(
    "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
    "JOIN order_items i ON i.order_id = o.id GROUP BY c.id "
    "ORDER BY SUM(i.quantity * i.price) DESC LIMIT 1"
).fetchone()
try:
    got = open("/app/answer.txt").read().strip()
except OSError as e:
    sys.exit(f"answer.txt: {e}")
if got != want:
    sys.exit(f"answer.txt holds {got!r}, want {want!r}")
