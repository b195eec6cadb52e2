"""Run output: metrics.jsonl, TensorBoard (when installed) and the PNG reward curve."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["RunLog", "plot_reward_curve", "read_metrics"]


class RunLog:
    """Append one JSON line per step to ``metrics.jsonl`` and mirror scalars to TensorBoard."""

    def __init__(self, run_dir: Path, *, tensorboard: bool) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self._fh = self.path.open("a", buffering=1)
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._tb = None
            else:
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        """Write one step's record (must contain ``step``)."""
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self._fh.write(json.dumps(clean, sort_keys=False) + "\n")
        if self._tb is not None:
            step = int(record["step"])
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        """Flush and close the files."""
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file."""
    with path.open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _step(row: dict[str, Any]) -> int:
    return int(row["step"])


def plot_reward_curve(metrics_path: Path, out_png: Path, *, title: str = "") -> Path:
    """Draw reward (and a 10-step moving average) and response length against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = read_metrics(metrics_path)
    # Runs before metrics were namespaced wrote bare keys.
    rows = [r for r in every if "rollout/reward_mean" in r or "reward_mean" in r]
    evals = sorted((r for r in every if any(k.startswith("eval/") for k in r)), key=_step)
    steps = [r["step"] for r in rows]
    reward = [r.get("rollout/reward_mean", r.get("reward_mean")) for r in rows]
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax.plot(steps, reward, ".", alpha=0.5, label="reward (training samples)")
    window = 10
    vals = [v for v in reward if v is not None]
    if len(vals) >= window:
        smooth = [sum(vals[i - window + 1 : i + 1]) / window for i in range(window - 1, len(vals))]
        ax.plot(
            steps[window - 1 : window - 1 + len(smooth)], smooth, "-", label=f"mean of {window}"
        )
    for key, style in (("eval/accuracy_greedy", "s-"), ("eval/accuracy_sampled", "^-")):
        pts = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=f"held-out {key.split('_')[-1]}")
    ax.set_ylabel("reward (task success rate)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or metrics_path.parent.name)
    lengths = [r.get("rollout/response_len_mean", r.get("response_len_mean")) for r in rows]
    ax2.plot(steps, lengths, "-", color="tab:gray")
    ax2.set_ylabel("response len")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out_png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
