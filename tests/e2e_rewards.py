"""Custom reward functions used by the end-to-end tests through `task.reward_fn`."""

from __future__ import annotations

from miles_rollout import Sample


def response_parity(sample: Sample) -> float:
    """1.0 for an even number of response characters: varies even for an untrained policy,
    so every group has a non-zero advantage and the weights must move."""
    return float(len(sample.response) % 2 == 0)


def checkpoint_evaluator(checkpoint_dir: str) -> dict[str, float] | None:
    """An external evaluator: counts the snapshot's safetensors bytes; skips step 2's."""
    from pathlib import Path

    from miles import SkipEval

    path = Path(checkpoint_dir)
    assert (path / "config.json").is_file(), f"{path} is not an HF checkpoint"
    if path.name.endswith("_000002"):
        raise SkipEval("step 2 is skipped on purpose")
    return {"weight_bytes": float(sum(p.stat().st_size for p in path.glob("*.safetensors")))}


def always_zero(sample: Sample) -> float:
    """A run that cannot learn: every group has zero reward variance."""
    return 0.0
