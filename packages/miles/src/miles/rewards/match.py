"""Exact match of the response against the label (or any item of a list label)."""

from __future__ import annotations

from typing import Any

__all__ = ["exact_match", "normalize_text"]


def normalize_text(text: Any) -> str:
    """Trimmed, whitespace collapsed, final period dropped, case folded."""
    return " ".join(str(text).strip().rstrip(".").split()).casefold()


def exact_match(sample: Any) -> float:
    """1.0 when the normalised response equals the normalised label (any item of a list)."""
    labels = sample.label if isinstance(sample.label, list) else [sample.label]
    got = normalize_text(sample.response or "")
    hit = any(got == normalize_text(x) for x in labels)
    sample.metadata["reward_info"] = {"response": got[:200], "matched": hit}
    return 1.0 if hit else 0.0
