"""Pre-flight checks before step 1 against an external engine (``rollout.engine_url``).

An engine started separately may serve another model, or the same model with other weights
(an older run, another checkpoint). Without these checks step 1 would train on that policy's
samples (a train/rollout logprob gap of ~0.4 instead of ~1e-7), or a whole rollout and train
step would run before the first weight push fails on a shape. So, before anything generates:

1. ``/get_model_info`` must describe the recipe's model: the architecture and, where the
   engine reports them, the vocabulary size and layer count must match ``config.json`` in
   ``model_path`` (a mismatch is a ``ValueError`` naming both).
2. The trainer's weights are pushed at version 0 with the recipe's weight sync (every rank
   takes part) and, with ``transfer.verify``, compared bit for bit; a failure names the engine.

The embedded engine loads ``model_path`` itself, so it needs neither.

The first push over HTTP starts this process's ``torch_shm_manager`` (CPU tensors travel as
shared-memory handles), which inherits stdin and stderr and outlives the run for as long as the
engine holds a connection to it: ``miles train ... 2>&1 | tail`` would then never see the end of
its input. So the manager is started here with ``/dev/null`` in their place.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from miles.config import RunConfig
    from miles.protocols import Trainer, WeightSync
    from miles.rollout.engines import RolloutEngines

__all__ = ["check_engine_model", "preflight", "start_shm_manager_detached"]

logger = logging.getLogger(__name__)
_shm_manager_probe: torch.UntypedStorage | None = None

# /get_model_info field -> config.json field (the first is SGLang's, the rest Miles extensions).
_COMPARED = {
    "architectures": "architectures",
    "model_type": "model_type",
    "vocab_size": "vocab_size",
    "num_hidden_layers": "num_hidden_layers",
}


def check_engine_model(info: dict[str, Any], model_path: str, url: str) -> None:
    """Compare an engine's ``/get_model_info`` with ``config.json`` in ``model_path``.

    Raises:
        ValueError: the engine reports a different architecture, vocabulary or depth.
    """
    config = json.loads((Path(model_path) / "config.json").read_text())
    diffs = []
    for info_key, cfg_key in _COMPARED.items():
        served, ours = info.get(info_key), config.get(cfg_key)
        if served is None or ours is None or not served:
            continue  # not reported (stock SGLang reports architectures and model_type only)
        if info_key == "architectures":
            served, ours = sorted(served), sorted(ours)
        if served != ours:
            diffs.append(f"{info_key} {served!r} (recipe's model: {ours!r})")
    if diffs:
        raise ValueError(
            f"the engine at {url} serves another model ({info.get('model_path')}): "
            f"{'; '.join(diffs)}. Start it with the recipe's model_path ({model_path}) or point "
            "rollout.engine_url at one that serves it"
        )


def start_shm_manager_detached() -> None:
    """Start this process's ``torch_shm_manager`` with ``/dev/null`` as its stdin and stderr.

    torch starts one manager per process, at the first CPU storage shared by file name, and
    the child inherits fds 0 and 2 (it replaces 1 with its own pipe). Started here first, it
    holds ``/dev/null`` instead of the caller's terminal or pipe; later shares reuse it. For
    the moment of the start, this process's own stderr goes to ``/dev/null`` too.
    """
    global _shm_manager_probe
    if _shm_manager_probe is not None:
        return
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDWR)
    saved = (os.dup(0), os.dup(2))
    try:
        os.dup2(null, 0)
        os.dup2(null, 2)
        probe = torch.UntypedStorage(1)
        probe._share_filename_cpu_()  # starts the manager
        _shm_manager_probe = probe  # kept: the manager stays up for the run's pushes
    finally:
        os.dup2(saved[0], 0)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


async def _model_info(engines: RolloutEngines) -> dict[str, Any]:
    async with engines.client() as client:
        return await client.get_model_info()


def _share(obj: Any, rank: int, world: int) -> Any:
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def preflight(
    cfg: RunConfig,
    engines: RolloutEngines | None,
    trainer: Trainer,
    weight_sync: WeightSync,
    *,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """On every rank, before step 1: with ``rollout.engine_url``, check the engine's model and
    give it the trainer's weights (version 0, verified). A no-op for the embedded engine.

    Returns:
        The version-0 sync's metrics (empty when nothing was done).

    Raises:
        ValueError: the engine serves another model, or refused or garbled the weights.
    """
    url = cfg.rollout.engine_url
    if url is None:
        return {}
    problem = None
    if engines is not None:  # rank 0
        try:
            info = asyncio.run(_model_info(engines))
            check_engine_model(info, cfg.model_path, url)
        except Exception as e:
            problem = str(e) if isinstance(e, ValueError) else f"{url}/get_model_info: {e!r}"
    problem = _share(problem, rank, world)  # every rank stops together, none waits in a gather
    if problem is not None:
        raise ValueError(problem)
    if cfg.transfer.method == "push" and engines is not None:
        start_shm_manager_detached()
    try:
        metrics = dict(weight_sync.sync(trainer, 0))
    except Exception as e:
        raise ValueError(
            f"pre-flight: pushing the trainer's weights (version 0) to the engine at {url} "
            f"failed: {e}. Does it serve the recipe's model ({cfg.model_path})?"
        ) from e
    if metrics.get("verified") is False:
        raise ValueError(
            f"pre-flight: after pushing the trainer's weights (version 0) the engine at {url} "
            f"holds different bytes: {metrics}"
        )
    logger.info("pre-flight: the engine at %s serves the trainer's weights (%s)", url, metrics)
    return metrics
