#!/bin/bash
set -euo pipefail
cd /app/textstats
sed -i 's/re.findall(r"\[a-z'"'"'\]+", text)/re.findall(r"[a-z'"'"']+", text.lower())/' words.py
sed -i 's/key=lambda kv: (kv\[1\], kv\[0\]), reverse=True/key=lambda kv: (-kv[1], kv[0])/' words.py
python3 -c 'import sys; sys.path.insert(0, "/app"); from textstats import top_words; print(top_words("b a c b a", 3))'
