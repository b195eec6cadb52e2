"""The RL loop: next batch -> train -> sync weights -> log, for any source, trainer and sync.

    for step in 1..num_steps:
        batch   = source.next_batch(step)        # rank 0; sync: generate now, async: from buffer
        metrics = trainer.train_step(batch)      # every rank, same batch
        update  = weight_sync.sync(trainer, step)  # every rank (gathers), rank 0 sends
        source.weights_updated(step)
        log rollout/*, train/*, update/*, time/* to metrics.jsonl

The three boundaries are the protocols in ``miles.protocols``; which implementation runs is the
recipe's choice (``rollout.mode``, ``trainer``, ``transfer``). Rank 0 owns the rollout and the run
directory. Launch one process (``miles train ...``) or several (``torchrun --nproc_per_node 2 -m
miles train ...``); the code is the same.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist
import yaml

from miles._runlog import RunLog
from miles.config import RunConfig
from miles.evaluation import Evaluator, build_evaluator
from miles.guards import RunStoppedError, StepGuard
from miles.plots import plot_run
from miles.preflight import preflight
from miles.protocols import RolloutSource, Trainer, WeightSync
from miles.resume import (
    checkpoint_dir,
    find_checkpoint,
    loop_state,
    prune,
    restore_loop_state,
    truncate_metrics,
)
from miles.rollout import AsyncRollout, RolloutEngines, SyncRollout, build_train_batch
from miles.rollout.buffer import token_versions
from miles.tasks import load_callable
from miles.weight_sync import build_weight_sync
from miles_rollout import Sample

__all__ = ["RunResult", "check_model_dir", "train"]


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
    _check_readable(p)
    return p


def _check_readable(p: Path) -> None:
    """config.json is a JSON object and every safetensors header reads (no tensor data is
    loaded), so a damaged checkpoint stops the run here, named, before the trainer loads it."""
    from safetensors import SafetensorError, safe_open

    fix = "write the checkpoint again (model.save_pretrained(dir)) or copy it again"
    try:
        config = json.loads((p / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{p / 'config.json'} is not valid JSON ({e}); {fix}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{p / 'config.json'} is not a JSON object; {fix}")
    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e}); {fix}") from None


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


def _namespaced(prefix: str, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Every scalar a component returned, under ``prefix/`` (nothing is dropped silently)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and callable(v.item):  # a 0-d tensor or numpy scalar
            v = v.item()
        if v is None or isinstance(v, bool | int | float | str):
            out[f"{prefix}/{k}"] = v
    return out


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


def build_trainer(cfg: RunConfig) -> Trainer:
    """The recipe's trainer (every rank): ``trainer.backend`` fsdp or megatron."""
    trainer: Trainer = cfg.trainer.build()
    return trainer


def build_source(cfg: RunConfig, engines: RolloutEngines) -> RolloutSource:
    """The recipe's rollout source (rank 0 only): ``rollout.mode`` sync or async."""
    if cfg.rollout.mode == "sync":
        return SyncRollout(cfg, engines)
    policy = cfg.rollout.staleness_policy
    fn = load_callable(policy) if ":" in policy else None
    return AsyncRollout(cfg, engines, staleness_fn=fn)


def _rollout_payload(
    source: RolloutSource, step: int, dump: TextIO | None, guard: StepGuard
) -> tuple[Any, dict[str, Any]]:
    """Rank 0: the next batch as a TrainBatch plus its ``rollout/`` metrics.

    Raises:
        RunStoppedError: the guard's checks (nothing to train on, too many drops, no signal).
    """
    rb = source.next_batch(step)
    batch, stats = build_train_batch(rb.groups)
    guard.check(
        step,
        len(rb.groups),
        batch,
        stats,
        reward_mean=rb.metrics.get("reward_mean"),
        groups=rb.groups,
    )
    if dump is not None and batch is not None:
        for group in rb.groups:
            if all(s.reward is not None for s in group):  # what build_train_batch kept
                for s in group:
                    dump.write(json.dumps(sample_record(s, step)) + "\n")
        dump.flush()
    metrics = {**rb.metrics, **stats}
    return batch, {**_namespaced("rollout", metrics), "time/rollout_s": rb.seconds}


def sample_record(sample: Sample, step: int) -> dict[str, Any]:
    """One line of ``samples.jsonl``: a trained sample with per-token masks and versions.

    ``loss_mask`` and ``weight_versions`` have one entry per token of ``tokens`` (prompt
    included): 0 / ``None`` where the policy did not generate the token.
    """
    prompt_len = sample.prompt_length
    versions = token_versions(sample)
    return {
        "step": step,
        "tokens": list(sample.tokens),
        "loss_mask": [0] * prompt_len + list(sample.loss_mask),
        "weight_versions": [None] * prompt_len + versions,
        "staleness": sample.metadata.get("staleness", 0),
        "reward": sample.reward,
    }


def train(cfg: RunConfig, *, resume: bool = False) -> RunResult | None:
    """Run the RL loop described by ``cfg``.

    Args:
        cfg: the run.
        resume: continue the run in ``cfg.run.out_dir`` from its newest checkpoint (its
            ``trainer/step_<N>/``) instead of starting a new one.

    Returns:
        Where the outputs are (on rank 0; ``None`` on other ranks).

    Raises:
        FileNotFoundError: the model directory is missing or incomplete.
        ValueError: a bad config value or a bad request (e.g. a prompt longer than the context).
    """
    check_model_dir(cfg.model_path)
    checkpoint = None
    if resume:
        if not cfg.run.out_dir:
            raise ValueError("resuming needs the run directory (run.out_dir)")
        checkpoint = find_checkpoint(Path(cfg.run.out_dir))
    trainer = build_trainer(cfg)
    rank, world = trainer.rank, trainer.world_size
    engines = RolloutEngines(cfg) if rank == 0 else None
    source: RolloutSource | None = None
    evaluator: Evaluator | None = None
    run_dir = Path(cfg.run.out_dir) if cfg.run.out_dir else _default_run_dir(cfg.name)
    log: RunLog | None = None
    dump: TextIO | None = None
    created = False
    steps_done = 0
    weight_sync: WeightSync | None = None
    try:
        if rank == 0 and checkpoint is None:
            if run_dir.exists() and any(run_dir.iterdir()):
                raise FileExistsError(f"run directory {run_dir} exists and is not empty")
            run_dir.mkdir(parents=True, exist_ok=True)
            created = True
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        weight_sync = build_weight_sync(
            cfg, engines.receiver if engines is not None else None, run_dir=run_dir
        )
        # An external engine must serve this model with these weights before anything
        # generates (an async source starts generating as soon as it exists).
        preflight(cfg, engines, trainer, weight_sync, rank=rank, world=world)
        source = build_source(cfg, engines) if engines is not None else None
        guard = StepGuard(
            max_drop_frac=cfg.rollout.max_drop_frac,
            no_signal_steps=cfg.run.no_signal_steps,
            no_signal_action=cfg.run.no_signal_action,
            reward_timeout_s=cfg.task.reward_timeout_s,
        )
        eval_on = cfg.run.eval_every > 0 and cfg.eval.mode != "none"
        if eval_on and engines is not None:
            evaluator = build_evaluator(cfg, engines, source)
        # Every rank knows the eval steps (snapshots are collectives).
        eval_needs_snapshot = _broadcast(
            evaluator.needs_snapshot if evaluator is not None else False, rank, world
        )

        def run_eval(step: int) -> None:
            snapshot = None
            if eval_needs_snapshot:
                snapshot = run_dir / "eval_snapshots" / f"step_{step:06d}"
                trainer.save_hf_checkpoint(snapshot)
            if evaluator is not None and log is not None:
                for row in evaluator.evaluate(step, snapshot):
                    log.log(row)

        start = 1
        if checkpoint is not None:
            # Last setup step: it restores every rank's RNG states.
            info = trainer.load_checkpoint(checkpoint)
            start = info.step + 1
            steps_done = info.step
            if engines is not None and source is not None:
                restore_loop_state(info.client_state, engines, source, guard)
                truncate_metrics(run_dir, info.step)
            # The engines still serve the checkpoint the run started from.
            weight_sync.sync(trainer, info.step)
            if source is not None:
                source.weights_updated(info.step)
        if rank == 0:
            log = RunLog.for_run(run_dir, cfg)
            if cfg.run.dump_samples:
                dump = (run_dir / "samples.jsonl").open("a" if checkpoint else "w")
        if eval_on and checkpoint is None:
            run_eval(0)
        with _progress(cfg.run.num_steps, rank == 0 and cfg.run.progress) as bar:
            if bar is not None:
                bar.update(start - 1)
            for step in range(start, cfg.run.num_steps + 1):
                t_step = time.perf_counter()
                payload: Any = None
                if source is not None:
                    try:
                        payload = ("ok", _rollout_payload(source, step, dump, guard))
                    except BaseException as e:
                        _broadcast(("error", repr(e)), rank, world)
                        raise
                payload = _broadcast(payload, rank, world)
                if payload[0] == "error":
                    raise RunStoppedError(f"rank 0 stopped in the rollout: {payload[1]}")
                batch, record = payload[1]
                t0 = time.perf_counter()
                train_metrics = trainer.train_step(batch) if batch is not None else {}
                t_train = time.perf_counter() - t0
                t0 = time.perf_counter()
                update = weight_sync.sync(trainer, step)
                t_update = time.perf_counter() - t0
                if source is not None:
                    source.weights_updated(step)
                if cfg.run.save_every and step % cfg.run.save_every == 0:
                    state = None
                    if engines is not None and source is not None:
                        state = loop_state(engines, source, guard)
                    trainer.save_checkpoint(
                        checkpoint_dir(run_dir, step), step=step, client_state=state
                    )
                    if rank == 0:
                        prune(run_dir, cfg.run.keep_checkpoints)
                steps_done = step
                if log is not None:
                    record = {
                        "step": step,
                        **record,
                        **_namespaced("train", train_metrics),
                        **_namespaced("update", update),
                        **(engines.metrics() if engines is not None else {}),
                        "time/train_s": t_train,
                        "time/update_s": t_update,
                        "time/step_s": time.perf_counter() - t_step,
                    }
                    # The share of the step the trainer waited for samples.
                    record["time/trainer_idle_frac"] = record["time/rollout_s"] / max(
                        record["time/step_s"], 1e-9
                    )
                    log.log(record)
                if eval_on and (step % cfg.run.eval_every == 0 or step == cfg.run.num_steps):
                    run_eval(step)
                if evaluator is not None and log is not None:
                    for row in evaluator.poll(step):
                        log.log(row)
                if log is not None and step % cfg.run.plot_every == 0:
                    plot_run(log.path, run_dir, title=cfg.name)
                if bar is not None:
                    reward = record.get("rollout/reward_mean")
                    bar.set_postfix(reward=f"{reward if reward is not None else float('nan'):.3f}")
                    bar.update(1)
        final = run_dir / "checkpoints" / "final"
        trainer.save_hf_checkpoint(final)
        if evaluator is not None and log is not None:
            for row in evaluator.finish(cfg.run.num_steps):
                log.log(row)
            shutil.rmtree(run_dir / "eval_snapshots", ignore_errors=True)
        if log is None:
            return None
        log.close()
        log = None
        png = plot_run(run_dir / "metrics.jsonl", run_dir, title=cfg.name)
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
        close = getattr(weight_sync, "close", None)
        if callable(close):
            close()
        if evaluator is not None:
            evaluator.close()
        if dump is not None:
            dump.close()
        if source is not None:
            source.close()
        elif engines is not None:
            engines.close()
