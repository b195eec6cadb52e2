import re
import sys
from collections import Counter

ips, paths = set(), Counter()
for line in open("/app/access.log"):
    m = re.match(r'(\S+) \S+ \S+ \[[^]]+\] "\S+ (\S+) [^"]+" (\d{3})', line)
    ip, path, status = m.groups()
    paths[path] += 1
    if status.startswith("5"):
        ips.add(ip)
want = [str(len(ips)), paths.most_common(1)[0][0]]
try:
    got = open("/app/answer.txt").read().split()
except OSError as e:
    sys.exit(f"answer.txt: {e}")
if got != want:
    sys.exit(f"answer.txt holds {got}, want {want}")
