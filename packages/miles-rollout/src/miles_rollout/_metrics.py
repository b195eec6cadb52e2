"""The ``/metrics`` endpoint's Prometheus text, from the engine's per-DP-rank internal states."""

from __future__ import annotations

from typing import Any

__all__ = ["prometheus_text"]

# Prometheus series: (name, type, help, key in a rank's internal state). SGLang's names where
# the meaning is the same (sglang-router and dashboards read them); ours under miles_rollout:.
_METRICS = [
    ("sglang:num_running_reqs", "gauge", "The number of running requests.", "num_running_reqs"),
    (
        "sglang:num_queue_reqs",
        "gauge",
        "The number of requests in the waiting queue.",
        "num_waiting_reqs",
    ),
    (
        "sglang:cache_hit_rate",
        "gauge",
        "The prefix cache hit rate (cached / prompt tokens since start).",
        "cache_hit_rate",
    ),
    (
        "sglang:prompt_tokens_total",
        "counter",
        "Prompt tokens of admitted requests.",
        "num_prompt_tokens",
    ),
    (
        "sglang:cached_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
        "num_cached_prompt_tokens",
    ),
    (
        "sglang:generation_tokens_total",
        "counter",
        "Generated tokens.",
        "num_generated_tokens",
    ),
    (
        "miles_rollout:prefill_tokens_total",
        "counter",
        "Tokens run through prefill (prompt tokens not served from a cache).",
        "num_prefill_tokens",
    ),
    (
        "miles_rollout:prefix_cache_tokens",
        "gauge",
        "Tokens held by the prefix cache.",
        "prefix_cache_tokens",
    ),
    (
        "miles_rollout:prefix_cache_capacity_tokens",
        "gauge",
        "The prefix cache's capacity in tokens.",
        "prefix_cache_capacity_tokens",
    ),
    (
        "miles_rollout:prefix_cache_evicted_tokens_total",
        "counter",
        "Tokens evicted from the prefix cache to make room.",
        "prefix_cache_evicted_tokens",
    ),
    (
        "miles_rollout:prefix_cache_reserved_tokens",
        "gauge",
        "Cached tokens reserved for live sessions.",
        "prefix_cache_reserved_tokens",
    ),
    (
        "miles_rollout:prefix_cache_sessions",
        "gauge",
        "Sessions holding a KV reservation.",
        "prefix_cache_sessions",
    ),
    (
        "miles_rollout:prefix_cache_reservations_refused_total",
        "counter",
        "Sessions refused a reservation (no room kept for them).",
        "prefix_cache_reservations_refused",
    ),
    (
        "miles_rollout:prefix_cache_reservations_dropped_total",
        "counter",
        "Reservations taken over by a growing session.",
        "prefix_cache_reservations_dropped",
    ),
    (
        "miles_rollout:prefix_cache_flushes_total",
        "counter",
        "Times the prefix cache was dropped (flush_cache or a weight update).",
        "prefix_cache_flushes",
    ),
]


def prometheus_text(states: list[dict[str, Any]]) -> str:
    """The Prometheus text exposition of per-DP-rank internal states (one label per rank)."""
    lines: list[str] = []
    for name, kind, help_text, key in _METRICS:
        values = [(rank, st[key]) for rank, st in enumerate(states) if key in st]
        if not values:
            continue
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {float(v)!r}' for rank, v in values)
    return "\n".join(lines) + "\n"
