#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'EOF'
import json
users = [u for u in json.load(open("users.json")) if u["active"] and u["role"] == "admin"]
users.sort(key=lambda u: u["last_login"], reverse=True)
open("active_admins.txt", "w").write("".join(u["email"] + "\n" for u in users))
EOF
