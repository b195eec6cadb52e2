"""The RL loop: generate -> train -> update weights -> log (synchronous for now).

Rank 0 owns the rollout (the embedded engine, or a client of SGLang servers) and the run
directory; every rank trains on its share of the batch and takes part in the weight gather.
Launch one process (``miles train ...``) or several (``torchrun --nproc_per_node 2 -m miles
train ...``); the code is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from miles._runlog import RunLog, plot_reward_curve
from miles.config import RunConfig
from miles.tasks import make_reward_fn, make_task
from miles_rollout import (
    Engine,
    LocalEngineClient,
    Sample,
    SGLangClient,
    generate_rollout,
    rollout_metrics,
)
from miles_trainer import FSDPTrainer, TrainBatch, grpo_advantages
from miles_transfer import HTTPReceiver, WeightReceiver, push_module_weights

__all__ = ["RunResult", "build_train_batch", "check_model_dir", "train"]


@dataclass(kw_only=True, slots=True)
class RunResult:
    """Where a finished run wrote its outputs."""

    run_dir: Path
    metrics_path: Path
    final_checkpoint: Path
    plot_path: Path


def check_model_dir(path: str) -> Path:
    """Fail early, with the fix, when the model directory is not a usable HF checkpoint."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model directory not found: {p}. Set model_path in the recipe (or --set "
            f"model_path=DIR); for the demo policy run `python tools/make_tiny_model.py` "
            f"(`make demo` does this)"
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json: it is not a Hugging Face checkpoint")
    if not any(p.glob("*.safetensors")):
        raise FileNotFoundError(f"{p} has no *.safetensors weights")
    return p


def build_train_batch(
    groups: list[list[Sample]],
) -> tuple[TrainBatch | None, dict[str, float]]:
    """Group-normalised (GRPO) advantages broadcast over each sample's response tokens.

    A group with any ungraded sample (aborted or failed) is dropped whole, because its
    baseline would be wrong. Returns ``(None, stats)`` when nothing is left to train on.
    """
    kept = [g for g in groups if g and all(s.reward is not None for s in g)]
    stats = {"groups_dropped": float(len(groups) - len(kept))}
    if not kept:
        return None, stats
    size = len(kept[0])
    assert all(len(g) == size for g in kept), "all groups must have the same size"
    samples = [s for g in kept for s in g]
    rewards = [float(s.reward) for s in samples]  # type: ignore[arg-type]
    adv = grpo_advantages(rewards, size)
    stats["zero_std_groups_frac"] = sum(1 for g in kept if len({s.reward for s in g}) == 1) / len(
        kept
    )
    for s in samples:
        s.check()
    batch = TrainBatch(
        tokens=[list(s.tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=[list(s.loss_mask) for s in samples],
        rollout_logprobs=[list(s.rollout_logprobs) for s in samples],
        advantages=[[a] * s.response_length for a, s in zip(adv, samples)],
    )
    return batch, stats


def _default_run_dir(name: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{stamp}"


def _broadcast(obj: Any, rank: int, world: int) -> Any:
    """rank 0's object on every rank (no-op in a single process)."""
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Rollout:
    """Rank 0's side: engine or SGLang client, tokenizer, task, reward."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.task = make_task(cfg.task)
        self.reward_fn = make_reward_fn(cfg.task, self.task)
        self.engine: Engine | None = None
        self.receiver: WeightReceiver
        if cfg.rollout.engine_url is None:
            engine_cfg = cfg.engine
            if engine_cfg.num_threads is None:
                # The embedded engine shares the process (and the cores) with the trainer. An
                # engine thread with its own multi-thread OpenMP team makes libgomp see more
                # threads than cores and stop spinning between parallel regions, so every op
                # of the train step then waits on futex wake-ups (measured: ~3,200 voluntary
                # context switches per `gen` train step and about 2x its time). One thread
                # decodes small models as fast as two. Set engine.num_threads to override.
                engine_cfg = dataclasses.replace(engine_cfg, num_threads=1)
            self.engine = Engine(engine_cfg)
            self.receiver = self.engine
            self.tokenizer = self.engine.tokenizer
        else:
            self.receiver = HTTPReceiver(cfg.rollout.engine_url)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        if self.tokenizer is None:
            raise FileNotFoundError(
                f"{cfg.model_path} has no tokenizer files; the rollout needs the chat template"
            )
        # One event loop for the whole run, not asyncio.run() per step: on exit asyncio.run
        # restores the SIGINT handler, and signal.getsignal/signal format repr() of the
        # finished main task, i.e. of the whole RolloutResult, every step (O(rollout size):
        # 11 ms at 64 samples x 88 tokens, 0.5 s at 512 x 1k tokens).
        self._loop = asyncio.new_event_loop()

    async def _generate(self) -> Any:
        cfg = self.cfg
        items = self.task.sample(cfg.rollout.prompts_per_step)
        client: Any
        if self.engine is not None:
            client = LocalEngineClient(self.engine)
        else:
            assert cfg.rollout.engine_url is not None
            client = SGLangClient(cfg.rollout.engine_url)
        async with client:
            return await generate_rollout(
                client,
                self.tokenizer,
                items,
                n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                sampling_params=cfg.sampling,
                reward_fn=self.reward_fn,
                max_concurrency=cfg.rollout.max_concurrency,
            )

    def step(self) -> tuple[TrainBatch | None, dict[str, float], float]:
        result = self._loop.run_until_complete(self._generate())
        batch, stats = build_train_batch(result.groups)
        metrics = rollout_metrics(result.samples)
        metrics.update(stats)
        return batch, metrics, result.seconds

    def close(self) -> None:
        loop = self._loop
        try:
            # What asyncio.run does on exit: cancel what is left (after an error or Ctrl-C;
            # cancelling drops the requests from the engine), then shut the loop down.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
            if self.engine is not None:
                self.engine.shutdown()


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc="miles train", unit="step", dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


_KEYS_FROM_TRAIN = (
    "kl",
    "entropy",
    "clip_frac",
    "loss",
    "pg_loss",
    "grad_norm",
    "ratio_mean",
    "train_rollout_logprob_abs_diff",
    "lr",
    "tokens",
)


def train(cfg: RunConfig) -> RunResult | None:
    """Run the RL loop described by ``cfg``.

    Returns:
        Where the outputs are (on rank 0; ``None`` on other ranks).

    Raises:
        FileNotFoundError: the model directory is missing or incomplete.
        ValueError: a bad config value or a bad request (e.g. a prompt longer than the context).
    """
    check_model_dir(cfg.model_path)
    trainer = FSDPTrainer(cfg.trainer)
    rank, world = trainer.rank, trainer.world_size
    rollout = _Rollout(cfg) if rank == 0 else None
    run_dir = Path(cfg.run.out_dir) if cfg.run.out_dir else _default_run_dir(cfg.name)
    log: RunLog | None = None
    created = False
    steps_done = 0
    try:
        if rank == 0:
            if run_dir.exists() and any(run_dir.iterdir()):
                raise FileExistsError(f"run directory {run_dir} exists and is not empty")
            run_dir.mkdir(parents=True, exist_ok=True)
            created = True
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            log = RunLog(run_dir, tensorboard=cfg.run.tensorboard)
        bucket_bytes = int(cfg.transfer.bucket_mb * 2**20)
        with _progress(cfg.run.num_steps, rank == 0 and cfg.run.progress) as bar:
            for step in range(1, cfg.run.num_steps + 1):
                t_step = time.perf_counter()
                payload: Any = None
                if rollout is not None:
                    try:
                        payload = rollout.step()
                    except BaseException as e:
                        _broadcast(("error", repr(e)), rank, world)
                        raise
                    payload = ("ok", payload)
                payload = _broadcast(payload, rank, world)
                if payload[0] == "error":
                    raise RuntimeError(f"rank 0 failed in the rollout: {payload[1]}")
                batch, metrics, t_rollout = payload[1]
                t0 = time.perf_counter()
                train_metrics = trainer.train_step(batch) if batch is not None else {}
                t_train = time.perf_counter() - t0
                t0 = time.perf_counter()
                report = push_module_weights(
                    trainer.model,
                    rollout.receiver if rollout is not None else None,
                    weight_version=str(step),
                    bucket_bytes=bucket_bytes,
                    verify=cfg.transfer.verify,
                )
                t_update = time.perf_counter() - t0
                if cfg.run.save_every and step % cfg.run.save_every == 0:
                    trainer.save_hf_checkpoint(run_dir / "checkpoints" / f"step_{step:06d}")
                steps_done = step
                if log is not None:
                    record: dict[str, Any] = {"step": step, **metrics}
                    record.update({k: train_metrics.get(k) for k in _KEYS_FROM_TRAIN})
                    record.update(
                        time_rollout_s=t_rollout,
                        time_train_s=t_train,
                        time_update_s=t_update,
                        time_step_s=time.perf_counter() - t_step,
                        weight_version=report.weight_version if report else str(step),
                        update_bytes=report.bytes if report else 0,
                        update_verified=bool(report and report.verified),
                    )
                    log.log(record)
                    if step % cfg.run.plot_every == 0:
                        plot_reward_curve(log.path, run_dir / "reward_curve.png", title=cfg.name)
                if bar is not None:
                    bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}")
                    bar.update(1)
        final = run_dir / "checkpoints" / "final"
        trainer.save_hf_checkpoint(final)
        if log is None:
            return None
        log.close()
        log = None
        png = plot_reward_curve(
            run_dir / "metrics.jsonl", run_dir / "reward_curve.png", title=cfg.name
        )
        return RunResult(
            run_dir=run_dir,
            metrics_path=run_dir / "metrics.jsonl",
            final_checkpoint=final,
            plot_path=png,
        )
    except BaseException:
        if log is not None:
            log.close()
        if created and steps_done == 0:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing worth keeping
        raise
    finally:
        if rollout is not None:
            rollout.close()
