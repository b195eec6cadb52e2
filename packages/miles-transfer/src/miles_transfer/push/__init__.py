"""Push: gather full tensors (FSDP2 shards included) on one rank and send them in buckets.

The path every engine supports: SGLang's ``update_weights_from_tensor`` over HTTP
(``HTTPReceiver``), or any in-process module (``ModuleReceiver``), checked bit for bit after
each update. ``WeightServer`` serves any receiver behind the same endpoints.
"""

from miles_transfer.push.http import HTTPReceiver, ReceiverError
from miles_transfer.push.module_receiver import ModuleReceiver
from miles_transfer.push.push import (
    DEFAULT_BUCKET_BYTES,
    SyncReport,
    WeightMismatchError,
    push_module_weights,
    push_weights,
)
from miles_transfer.push.server import WeightServer
from miles_transfer.push.state import bucketize, iter_full_state
from miles_transfer.push.wire import (
    deserialize_named_tensors,
    discard_serialized,
    serialize_named_tensors,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "HTTPReceiver",
    "ModuleReceiver",
    "ReceiverError",
    "SyncReport",
    "WeightMismatchError",
    "WeightServer",
    "bucketize",
    "deserialize_named_tensors",
    "discard_serialized",
    "iter_full_state",
    "push_module_weights",
    "push_weights",
    "serialize_named_tensors",
]
