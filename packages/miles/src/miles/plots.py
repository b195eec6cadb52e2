"""A run's pictures, redrawn from ``metrics.jsonl`` as it grows: the reward curve always, the
asynchronous loop's and the agentic numbers when the run logged them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles._runlog import plot_reward_curve

__all__ = ["plot_async", "plot_run"]


def plot_run(metrics_path: Path, run_dir: Path, *, title: str = "") -> Path:
    """Draw ``reward_curve.png``, plus ``async.png`` and ``agentic.png`` where they apply.

    Returns:
        The reward curve's path.
    """
    png = plot_reward_curve(metrics_path, run_dir / "reward_curve.png", title=title)
    plot_async(metrics_path, run_dir / "async.png", title=title)
    try:
        from miles.agentic.plot import plot_agentic
    except ImportError:  # miles-env is not installed: no agentic metrics either
        return png
    plot_agentic(metrics_path, run_dir / "agentic.png", title=title)
    return png


def plot_async(metrics_path: Path, out_png: Path, *, title: str = "") -> Path | None:
    """Buffer occupancy, staleness and idle fractions per step of an asynchronous run.

    Returns:
        ``out_png``, or ``None`` when the run logged no asynchronous-rollout metrics.
    """
    with Path(metrics_path).open() as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    rows = [r for r in rows if "rollout/buffer_groups" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]

    def col(key: str) -> list[Any]:
        return [r.get(key) for r in rows]

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    ax1.plot(steps, col("rollout/buffer_groups"), "-", label="groups in the buffer")
    for key in ("rollout/retried", "rollout/dropped", "rollout/rejected"):
        ax1.plot(steps, col(key), ".", label=key.split("/")[1])
    ax1.set_ylabel("groups")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.plot(steps, col("rollout/staleness_mean"), "-", label="mean")
    ax2.plot(steps, col("rollout/staleness_max"), ".", label="max")
    ax2.set_ylabel("staleness (versions)")
    ax2.legend(loc="upper right", fontsize=8)
    ax3.plot(steps, col("time/trainer_idle_frac"), "-", label="trainer idle")
    ax3.plot(steps, col("rollout/engine_idle_frac"), "-", label="engine idle")
    ax3.set_ylim(-0.02, 1.02)
    ax3.set_ylabel("fraction of the step")
    ax3.set_xlabel("step")
    ax3.legend(loc="upper right", fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    ax1.set_title(title or Path(metrics_path).parent.name)
    fig.tight_layout()
    tmp = out_png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
