"""Resumable checkpoints of a run: the trainer's state plus the loop's own (data position,
async buffer, guard), and ``miles train --resume RUN_DIR``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_trainer.checkpoint import latest_checkpoint, prune_checkpoints

__all__ = [
    "checkpoint_dir",
    "find_checkpoint",
    "loop_state",
    "prune",
    "restore_loop_state",
    "truncate_metrics",
]

_FORMAT = 1


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where the resumable checkpoint of ``step`` goes."""
    return run_dir / "trainer" / f"step_{step:06d}"


def find_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run directory.

    Raises:
        FileNotFoundError: not a run directory, or it holds no complete checkpoint.
    """
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a miles run directory (no config.yaml): give the directory a "
            "`miles train` run printed"
        )
    found = latest_checkpoint(run_dir / "trainer")
    if found is None:
        raise FileNotFoundError(
            f"{run_dir} holds no complete checkpoint under trainer/: the run saved none (set "
            "run.save_every to write resumable checkpoints)"
        )
    return found


def loop_state(engines: Any, source: Any, guard: Any) -> dict[str, Any]:
    """Rank 0's part of a checkpoint: what the loop needs besides the trainer."""
    return {
        "format": _FORMAT,
        "prompts_drawn": engines.prompts_drawn,
        "source": source.state_dict(),
        "no_signal_streak": guard.streak,
    }


def restore_loop_state(state: Any, engines: Any, source: Any, guard: Any) -> None:
    """Put the data position, the source's buffer and the guard back (rank 0).

    Raises:
        ValueError: the checkpoint holds no loop state of this format.
    """
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(
            "the checkpoint holds no miles loop state (was it written by `miles train`?)"
        )
    engines.skip(int(state["prompts_drawn"]))
    source.load_state_dict(state["source"])
    guard.streak = int(state["no_signal_streak"])


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (rank 0, after a save)."""
    prune_checkpoints(run_dir / "trainer", keep)


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop ``metrics.jsonl`` and ``samples.jsonl`` rows of steps after ``step`` (they are
    redone), atomically."""
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = run_dir / name
        if not path.is_file():
            continue
        keep = [
            line
            for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step
        ]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
