"""Evaluation on held-out prompts, in three modes (``eval.mode``): shared, dedicated, external."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.evaluation.modes import Evaluator, SharedEval, SkipEval, SnapshotEval
from miles.evaluation.run import evaluate, heldout_prompts

if TYPE_CHECKING:
    from miles.config import RunConfig
    from miles.rollout.engines import RolloutEngines

__all__ = [
    "Evaluator",
    "SharedEval",
    "SkipEval",
    "SnapshotEval",
    "build_evaluator",
    "evaluate",
    "heldout_prompts",
]


def build_evaluator(cfg: RunConfig, engines: RolloutEngines, source: Any) -> Evaluator | None:
    """The recipe's evaluator on rank 0 (``None`` when ``eval.mode`` is ``none``).

    Raises:
        ValueError: ``eval.evaluator`` does not import.
    """
    mode = cfg.eval.mode
    if mode == "none":
        return None
    if mode == "shared":
        pause = source if hasattr(source, "pause_admission") else None
        return SharedEval(cfg, engines, pause)
    external = None
    if mode == "external":
        from miles.tasks import load_callable

        assert cfg.eval.evaluator is not None
        external = load_callable(cfg.eval.evaluator)
    return SnapshotEval(
        cfg,
        task=engines.task,
        reward_fn=engines.reward_fn,
        tokenizer=engines.tokenizer,
        external=external,
    )
