"""miles-transfer: move policy weights from a trainer to inference engines, verified bit for bit.

Depends on torch and the standard library only, so it installs alone into any RL stack.
"""

from miles_transfer._delta import DeltaReport, encode_delta
from miles_transfer._delta_apply import VerifyReport, apply_delta, recover_target, verify_delta
from miles_transfer._delta_engine import (
    DiskReloadEngine,
    EngineUpdateReport,
    PausableEngine,
    update_engine_from_delta,
    update_engine_via_disk,
)
from miles_transfer._delta_materialize import DeltaBaseError, MaterializeReport, materialize_delta
from miles_transfer._delta_publish import (
    DeltaPublisher,
    DeltaSubscriber,
    PublishReport,
    PullReport,
    version_dir_name,
)
from miles_transfer._digest import tensor_digest
from miles_transfer._dist_exit import shutdown_process_group, wait_for_gloo_workers
from miles_transfer._http import HTTPReceiver, ReceiverError
from miles_transfer._layout import Layout, LocalTensor, ParamSpec, Piece, RankLayout, materialize
from miles_transfer._layout_megatron import megatron_layout
from miles_transfer._layout_models import (
    ModelShape,
    fsdp_layout,
    qwen3_params,
    replicated_layout,
    shard_dim0,
    split_layout,
)
from miles_transfer._layout_sglang import sglang_layout
from miles_transfer._module_receiver import ModuleReceiver
from miles_transfer._p2p import (
    DEFAULT_P2P_BUCKET_BYTES,
    BucketTiming,
    ShardReceiver,
    ShardSender,
    TransferReport,
    dst_peer,
    reshard_local,
    src_peer,
)
from miles_transfer._p2p_module import module_buffers, module_param_specs, module_shards
from miles_transfer._plan import CopyOp, TransferPlan, clear_plan_cache, plan_transfer
from miles_transfer._push import (
    DEFAULT_BUCKET_BYTES,
    SyncReport,
    WeightMismatchError,
    push_module_weights,
    push_weights,
)
from miles_transfer._receiver import WeightReceiver
from miles_transfer._reshard import (
    copy_ops,
    pack,
    packed_bytes,
    reshard_native_available,
    reshard_native_error,
    unpack,
)
from miles_transfer._safetensors import iter_safetensors, save_safetensors
from miles_transfer._server import WeightServer
from miles_transfer._state import bucketize, iter_full_state
from miles_transfer._transport import Transport, TransportError
from miles_transfer._transport_dist import TorchDistributedTransport
from miles_transfer._transport_local import InProcessHub, InProcessTransport
from miles_transfer._transport_mooncake import MooncakeTransport, mooncake_available
from miles_transfer._transport_socket import ShmTransport, TcpTransport
from miles_transfer._wire import (
    deserialize_named_tensors,
    discard_serialized,
    serialize_named_tensors,
)
from miles_transfer.version import __version__

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_P2P_BUCKET_BYTES",
    "BucketTiming",
    "CopyOp",
    "DeltaBaseError",
    "DeltaPublisher",
    "DeltaReport",
    "DeltaSubscriber",
    "DiskReloadEngine",
    "EngineUpdateReport",
    "HTTPReceiver",
    "InProcessHub",
    "InProcessTransport",
    "Layout",
    "LocalTensor",
    "MaterializeReport",
    "ModelShape",
    "ModuleReceiver",
    "MooncakeTransport",
    "ParamSpec",
    "PausableEngine",
    "Piece",
    "PublishReport",
    "PullReport",
    "RankLayout",
    "ReceiverError",
    "ShardReceiver",
    "ShardSender",
    "ShmTransport",
    "SyncReport",
    "TcpTransport",
    "TorchDistributedTransport",
    "TransferPlan",
    "TransferReport",
    "Transport",
    "TransportError",
    "VerifyReport",
    "WeightMismatchError",
    "WeightReceiver",
    "WeightServer",
    "__version__",
    "apply_delta",
    "bucketize",
    "clear_plan_cache",
    "copy_ops",
    "deserialize_named_tensors",
    "discard_serialized",
    "dst_peer",
    "encode_delta",
    "fsdp_layout",
    "iter_full_state",
    "iter_safetensors",
    "materialize",
    "materialize_delta",
    "megatron_layout",
    "module_buffers",
    "module_param_specs",
    "module_shards",
    "mooncake_available",
    "pack",
    "packed_bytes",
    "plan_transfer",
    "push_module_weights",
    "push_weights",
    "qwen3_params",
    "recover_target",
    "replicated_layout",
    "reshard_local",
    "reshard_native_available",
    "reshard_native_error",
    "save_safetensors",
    "serialize_named_tensors",
    "sglang_layout",
    "shard_dim0",
    "shutdown_process_group",
    "split_layout",
    "src_peer",
    "tensor_digest",
    "unpack",
    "update_engine_from_delta",
    "update_engine_via_disk",
    "verify_delta",
    "version_dir_name",
    "wait_for_gloo_workers",
]
