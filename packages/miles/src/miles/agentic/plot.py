"""The agentic picture of a run: reward by task, turns and tool use, sandbox vs generation time.

    plot_agentic(run_dir / "metrics.jsonl", run_dir / "agentic.png")

Reads the ``rollout/agentic/*`` numbers of each step: the means over the step's episodes of
what ``miles_env.rollout.terminal_agent`` reports per sample (``metadata["metrics"]``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["PREFIX", "plot_agentic"]

PREFIX = "rollout/agentic/"


def _rows(path: Path) -> list[dict[str, Any]]:
    with path.open() as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [r for r in rows if f"{PREFIX}turns" in r]


def plot_agentic(metrics_path: Path, out_png: Path, *, title: str = "") -> Path | None:
    """Draw three panels against the step: mean reward of each task; turns, tool calls and
    tool errors per episode; seconds per episode in sandboxes and in generation, with the
    sandbox share of the two.

    Returns:
        ``out_png``, or ``None`` when the run logged no agentic metrics.
    """
    rows = _rows(Path(metrics_path))
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    tasks = sorted(
        {k[len(PREFIX + "reward/") :] for r in rows for k in r if k.startswith(PREFIX + "reward/")}
    )
    for task in tasks:
        key = f"{PREFIX}reward/{task}"
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax1.plot(*zip(*pts), ".-", label=task, alpha=0.8)
    ax1.set_ylabel("reward by task")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    if tasks:
        ax1.legend(fontsize=7, ncol=2, loc="lower right")
    ax1.set_title(title or Path(metrics_path).parent.name)

    def series(name: str) -> list[float]:
        return [float(r.get(PREFIX + name) or 0.0) for r in rows]

    ax2.plot(steps, series("turns"), "o-", label="turns")
    ax2.plot(steps, series("tool_calls"), "s-", label="tool calls")
    ax2.plot(steps, series("tool_errors"), "x-", label="tool errors")
    ax2.set_ylabel("per episode")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)

    box, gen = series("sandbox_s"), series("generate_s")
    ax3.bar(steps, gen, label="generation s", color="tab:blue")
    ax3.bar(steps, box, bottom=gen, label="sandbox s", color="tab:orange")
    ax3.set_ylabel("seconds / episode")
    ax3.set_xlabel("step")
    ax3.grid(alpha=0.3)
    share = ax3.twinx()
    share.plot(steps, series("sandbox_frac"), "k.-", label="sandbox share")
    share.set_ylim(0, 1.02)
    share.set_ylabel("sandbox share")
    handles = ax3.get_legend_handles_labels()
    extra = share.get_legend_handles_labels()
    ax3.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(out_png)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
