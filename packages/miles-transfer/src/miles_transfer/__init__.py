"""miles-transfer: move policy weights from a trainer to inference engines, verified bit for bit.

Three ways, one subpackage each:

- ``miles_transfer.push``: gather full tensors and send them in buckets (``push_module_weights``
  into an ``HTTPReceiver``, a ``ModuleReceiver``, or a ``ColocatedReceiver`` for an engine on
  the trainer's GPUs: CUDA IPC handles), then compare per-tensor digests.
- ``miles_transfer.p2p``: every trainer rank sends its own shards, re-sharded into each engine
  rank's layout (``plan_transfer``, ``ShardSender``, ``ShardReceiver``; ``p2p.layouts``,
  ``p2p.transports``).
- ``miles_transfer.delta``: publish disk deltas of the rollout-precision weights
  (``DeltaPublisher``) that engines pull and apply with a pause only for the swap
  (``DeltaSubscriber``, ``update_engine_from_delta``).

``miles_transfer.protocols`` holds the contracts (``WeightReceiver``, ``PausableEngine``,
``DiskReloadEngine``, ``Transport``). Depends on torch and the standard library only, so it
installs alone into any RL stack.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from miles_transfer.delta.engine import update_engine_from_delta
from miles_transfer.delta.publish import DeltaPublisher, DeltaSubscriber
from miles_transfer.digest import tensor_digest
from miles_transfer.p2p.plan import plan_transfer
from miles_transfer.p2p.transfer import ShardReceiver, ShardSender
from miles_transfer.protocols import WeightReceiver
from miles_transfer.push.colocated import ColocatedReceiver
from miles_transfer.push.http import HTTPReceiver
from miles_transfer.push.module_receiver import ModuleReceiver
from miles_transfer.push.push import SyncReport, push_module_weights, push_weights
from miles_transfer.version import __version__

__all__ = [
    "ColocatedReceiver",
    "DeltaPublisher",
    "DeltaSubscriber",
    "HTTPReceiver",
    "ModuleReceiver",
    "ShardReceiver",
    "ShardSender",
    "SyncReport",
    "WeightReceiver",
    "__version__",
    "plan_transfer",
    "push_module_weights",
    "push_weights",
    "tensor_digest",
    "update_engine_from_delta",
]

# Names that were top-level before the subpackages: still resolved, with a DeprecationWarning that
# names the new home (CHANGELOG). Remove at the first release.
_MOVED = {
    "miles_transfer.push": (
        "DEFAULT_BUCKET_BYTES ReceiverError WeightMismatchError WeightServer bucketize "
        "deserialize_named_tensors discard_serialized iter_full_state serialize_named_tensors"
    ),
    "miles_transfer.p2p": (
        "DEFAULT_P2P_BUCKET_BYTES BucketTiming CopyOp TransferPlan TransferReport "
        "clear_plan_cache copy_ops dst_peer module_buffers module_param_specs module_shards pack "
        "packed_bytes reshard_local reshard_native_available reshard_native_error src_peer unpack"
    ),
    "miles_transfer.p2p.layouts": (
        "Layout LocalTensor ModelShape ParamSpec Piece RankLayout fsdp_layout materialize "
        "megatron_layout qwen3_params replicated_layout sglang_layout shard_dim0 split_layout"
    ),
    "miles_transfer.p2p.transports": (
        "InProcessHub InProcessTransport MooncakeTransport ShmTransport TcpTransport "
        "TorchDistributedTransport Transport TransportError mooncake_available"
    ),
    "miles_transfer.delta": (
        "DeltaBaseError DeltaReport EngineUpdateReport MaterializeReport PublishReport "
        "PullReport VerifyReport apply_delta encode_delta materialize_delta recover_target "
        "update_engine_via_disk verify_delta version_dir_name"
    ),
    "miles_transfer.protocols": "DiskReloadEngine PausableEngine",
    "miles_transfer.checkpoint": "iter_safetensors save_safetensors",
    "miles_transfer.dist": "shutdown_process_group wait_for_gloo_workers",
}
_NEW_HOME = {name: mod for mod, names in _MOVED.items() for name in names.split()}


def __getattr__(name: str) -> Any:
    module = _NEW_HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_transfer' has no attribute {name!r}")
    warnings.warn(
        f"miles_transfer.{name} moved to {module}.{name}; import it from there",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
