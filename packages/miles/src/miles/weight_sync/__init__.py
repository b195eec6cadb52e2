"""How the trainer's weights reach the engines after each step (``transfer.method``).

``build_weight_sync(cfg, receiver, run_dir=...)`` makes the recipe's ``WeightSync``:

- ``push`` (``PushSync``): gather full tensors, send buckets from rank 0, compare digests;
- ``p2p`` (``P2PSync``): every trainer rank (FSDP2 or Megatron) sends its own shard, re-sharded
  into the engine's layout;
- ``delta`` (``DeltaSync``): publish disk deltas that the engine pulls and applies;
- ``colocated`` (``ColocatedSync``): every trainer rank on the engine's GPUs shares its own copy
  (CUDA IPC handles on GPU, shared memory on CPU) in one request.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from miles.weight_sync.colocated import ColocatedSync
from miles.weight_sync.delta import DeltaSync
from miles.weight_sync.p2p import P2PSync
from miles.weight_sync.push import PushSync
from miles_transfer import WeightReceiver
from miles_transfer.auth import resolve_api_key

if TYPE_CHECKING:
    from miles.config import RunConfig
    from miles.protocols import WeightSync

__all__ = ["ColocatedSync", "DeltaSync", "P2PSync", "PushSync", "build_weight_sync"]


def build_weight_sync(
    cfg: RunConfig, receiver: WeightReceiver | None, *, run_dir: Path | None = None
) -> WeightSync:
    """The recipe's weight sync (``cfg.transfer.method``), on every rank.

    Args:
        cfg: the run.
        receiver: rank 0's engine (the embedded engine, or an ``HTTPReceiver`` for
            ``rollout.engine_url``); ``None`` on other ranks.
        run_dir: the run directory; ``delta`` publishes under ``run_dir/weights`` unless
            ``transfer.delta.dir`` is set. Nothing is created before the first sync.

    Raises:
        ValueError: ``delta`` with neither ``transfer.delta.dir`` nor a run directory.
    """
    t = cfg.transfer
    bucket_bytes = int(t.bucket_mb * 2**20)
    if t.method == "colocated":
        return ColocatedSync(
            receiver,
            engine_url=cfg.rollout.engine_url,
            api_key=resolve_api_key(cfg.rollout.api_key),
            bucket_bytes=bucket_bytes,
            verify=t.verify,
            handle_version=t.colocated.handle_version,
            check_handles=t.colocated.check_handles,
        )
    if t.method == "p2p":
        return P2PSync(
            receiver,
            engine_url=cfg.rollout.engine_url,
            transport=t.p2p.transport,
            host=t.p2p.host,
            agent=t.p2p.agent,
            bucket_bytes=bucket_bytes,
            verify=t.verify,
            api_key=resolve_api_key(cfg.rollout.api_key),
        )
    if t.method == "delta":
        owns_root = t.delta.dir is None
        if t.delta.dir is not None:
            root = Path(t.delta.dir)
        elif run_dir is not None:
            root = Path(run_dir) / "weights"
        else:
            raise ValueError(
                "transfer.method delta needs transfer.delta.dir (the publish directory) when "
                "no run directory is given"
            )
        return DeltaSync(
            receiver,
            root=root,
            model_path=cfg.model_path,
            local_dir=Path(t.delta.local_dir) if t.delta.local_dir else None,
            encoding=t.delta.encoding,
            full_every=t.delta.full_every,
            verify=t.verify,
            owns_root=owns_root,
        )
    return PushSync(receiver, bucket_bytes=bucket_bytes, verify=t.verify)
