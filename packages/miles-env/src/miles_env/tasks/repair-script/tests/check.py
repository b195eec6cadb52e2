import os
import subprocess
import sys
import tempfile

d = tempfile.mkdtemp()
files = {"a b.txt": "one two three\nfour\n", "c.txt": "x\n\n y z\n", "-x.txt": "w\n"}
for name, text in files.items():
    with open(os.path.join(d, name), "w") as f:
        f.write(text)
args = ["./a b.txt", "c.txt", "./-x.txt"]
if not os.access("/app/wordcount.sh", os.X_OK):
    sys.exit("wordcount.sh is not executable")
r = subprocess.run(["/app/wordcount.sh", *args], cwd=d, capture_output=True, text=True)
want = "4 ./a b.txt\n3 c.txt\n1 ./-x.txt\n8 total\n"
if r.returncode != 0 or r.stdout != want:
    sys.exit(f"exit {r.returncode}, output {r.stdout!r}, want {want!r}; stderr {r.stderr!r}")
