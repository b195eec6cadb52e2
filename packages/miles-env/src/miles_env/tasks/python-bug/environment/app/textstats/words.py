"""Word frequencies."""

import re
from collections import Counter


def top_words(text, n):
    """The n most frequent words of text, case-insensitive, ignoring punctuation,
    as (word, count) pairs sorted by count (highest first), then alphabetically."""
    words = re.findall(r"[a-z']+", text)
    counts = Counter(words)
    ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    return ranked[:n]
