"""P2P: every trainer rank sends its own shards; every engine rank receives only its own.

``plan_transfer(src_layout, dst_layout)`` gives the exact copies between two layouts
(``miles_transfer.p2p.layouts``); ``ShardSender`` / ``ShardReceiver`` move them bucket by bucket
over a transport (``miles_transfer.p2p.transports``), re-sharding on the way (native C++ or the
PyTorch reference); ``reshard_local`` does it in one process.
"""

from miles_transfer.p2p.module import module_buffers, module_param_specs, module_shards, tied_names
from miles_transfer.p2p.plan import CopyOp, TransferPlan, clear_plan_cache, plan_transfer
from miles_transfer.p2p.reshard import (
    copy_ops,
    pack,
    packed_bytes,
    reshard_native_available,
    reshard_native_error,
    unpack,
)
from miles_transfer.p2p.transfer import (
    DEFAULT_P2P_BUCKET_BYTES,
    BucketTiming,
    ShardReceiver,
    ShardSender,
    TransferReport,
    dst_peer,
    reshard_local,
    src_peer,
)

__all__ = [
    "DEFAULT_P2P_BUCKET_BYTES",
    "BucketTiming",
    "CopyOp",
    "ShardReceiver",
    "ShardSender",
    "TransferPlan",
    "TransferReport",
    "clear_plan_cache",
    "copy_ops",
    "dst_peer",
    "module_buffers",
    "module_param_specs",
    "module_shards",
    "pack",
    "packed_bytes",
    "plan_transfer",
    "reshard_local",
    "reshard_native_available",
    "reshard_native_error",
    "src_peer",
    "tied_names",
    "unpack",
]
