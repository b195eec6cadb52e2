import json
import sys

users = json.load(open("/app/users.json"))
chosen = [u for u in users if u["active"] and u["role"] == "admin"]
want = [u["email"] for u in sorted(chosen, key=lambda u: u["last_login"], reverse=True)]
try:
    got = open("/app/active_admins.txt").read().split()
except OSError as e:
    sys.exit(f"active_admins.txt: {e}")
if got != want:
    sys.exit(f"active_admins.txt holds {got}, want {want}")
