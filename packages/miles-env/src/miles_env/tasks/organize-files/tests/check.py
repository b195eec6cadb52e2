import os
import sys

want = {"pdf/report.PDF": "pdf", "txt/notes.txt": "txt", "jpg/photo.jpg": "jpg",
        "pdf/scan.pdf": "pdf2", "other/Makefile": "all:", "gz/archive.tar.gz": "gz",
        "txt/todo list.txt": "todo", "other/LICENSE": "mit"}
got = {}
for root, _, files in os.walk("/app/sorted"):
    for f in files:
        p = os.path.join(root, f)
        got[os.path.relpath(p, "/app/sorted")] = open(p).read().strip()
left = os.listdir("/app/inbox") if os.path.isdir("/app/inbox") else []
if got != want or left:
    sys.exit(f"sorted: {sorted(got.items())}; want {sorted(want.items())}; inbox still has {left}")
