import re
import subprocess
import sys

src = "/app/src"
r = subprocess.run([sys.executable, "main.py"], cwd=src, capture_output=True, text=True)
if r.stdout != "ada\ngrace\n":
    sys.exit(f"main.py printed {r.stdout!r}; stderr {r.stderr!r}")
api = open(f"{src}/users/api.py").read()
main = open(f"{src}/main.py").read()
legacy = open(f"{src}/users/legacy.py").read()
code_names = re.findall(r"\bfetch_usr\b(?!_)", re.sub(r'""".*?"""', "", api + main, flags=re.S))
checks = [
    ("def fetch_user(user_id)" in api, "api.py defines fetch_user"),
    ("fetch_user(i) for i in ids" in api, "fetch_many calls fetch_user"),
    ("from users.api import fetch_user" in main, "main.py imports fetch_user"),
    (not code_names, f"code still uses fetch_usr: {code_names}"),
    ("def fetch_usr_legacy(user_id)" in legacy, "fetch_usr_legacy untouched"),
    ("'fetch_usr' is the old name" in api, "the docstring untouched"),
]
failed = [msg for ok, msg in checks if not ok]
if failed:
    sys.exit("; ".join(failed))
