"""Run output: metrics.jsonl, TensorBoard and Weights & Biases (optional), the PNG reward curve.

TensorBoard (``run.tensorboard``): ``null`` (default) logs when it is installed, ``true``
requires it (``pip install 'miles[tensorboard]'``), ``false`` turns it off. W&B
(``run.wandb: true``; ``pip install 'miles[wandb]'``) logs the same scalars and the resolved
config under ``run.wandb_project``, in ``run.wandb_mode`` (``offline`` by default: files under
``<run dir>/wandb``, no network; ``wandb sync`` uploads them later; ``online`` logs live).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.config import RunConfig

__all__ = ["RunLog", "plot_reward_curve", "read_metrics"]


def _tensorboard_writer(run_dir: Path, required: bool) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        if required:
            raise ImportError(
                "run.tensorboard: true needs TensorBoard: pip install 'miles[tensorboard]' "
                "(or pip install tensorboard), or set run.tensorboard: false"
            ) from e
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def _wandb_run(run_dir: Path, *, project: str, mode: str, name: str, config: Any) -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "run.wandb: true needs Weights & Biases: pip install 'miles[wandb]' (or pip install "
            "wandb), or set run.wandb: false"
        ) from e
    return wandb.init(
        project=project,
        name=name,
        dir=str(run_dir),
        mode=mode,  # type: ignore[arg-type,unused-ignore]  # checked by RunSettings: "offline" | "online"
        config=config,
        settings=wandb.Settings(console="off", silent=True),
    )


class RunLog:
    """Append one JSON line per step to ``metrics.jsonl`` and mirror scalars to TensorBoard
    and W&B.

    Args:
        run_dir: the run directory.
        tensorboard: ``None``: when installed; ``True``: required; ``False``: off.
        wandb: also log to Weights & Biases (required: ImportError naming the extra).
        wandb_project: the W&B project.
        wandb_mode: ``"offline"`` (files only, no network) or ``"online"``.
        name: the run's name (W&B).
        config: the resolved run config, recorded by W&B.

    Raises:
        ImportError: a backend asked for (``True``) is not installed; the message says what to
            install.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool | None = None,
        wandb: bool = False,
        wandb_project: str = "miles",
        wandb_mode: str = "offline",
        name: str | None = None,
        config: Any = None,
    ) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard is not False:
            self._tb = _tensorboard_writer(run_dir, required=tensorboard is True)
        if wandb:
            try:
                self._wandb = _wandb_run(
                    run_dir,
                    project=wandb_project,
                    mode=wandb_mode,
                    name=name or run_dir.name,
                    config=config,
                )
            except BaseException:
                if self._tb is not None:
                    self._tb.close()
                raise
        self._fh = self.path.open("a", buffering=1)

    @classmethod
    def for_run(cls, run_dir: Path, cfg: RunConfig) -> RunLog:
        """The run log the recipe's ``run`` section asks for."""
        run = cfg.run
        return cls(
            run_dir,
            tensorboard=run.tensorboard,
            wandb=run.wandb,
            wandb_project=run.wandb_project,
            wandb_mode=run.wandb_mode,
            name=cfg.name,
            config=cfg.to_dict(),
        )

    def log(self, record: dict[str, Any]) -> None:
        """Write one step's record (must contain ``step``)."""
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self._fh.write(json.dumps(clean, sort_keys=False) + "\n")
        if self._tb is None and self._wandb is None:
            return
        step = int(record["step"])
        scalars = {
            k: v
            for k, v in clean.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close the files (and finish the W&B run)."""
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


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
