#!/bin/bash
set -euo pipefail
cat > /app/wordcount.sh <<'EOF'
#!/bin/sh
total=0
for f in "$@"; do
  n=$(wc -w < "$f")
  echo "$n $f"
  total=$((total + n))
done
echo "$total total"
EOF
chmod +x /app/wordcount.sh
