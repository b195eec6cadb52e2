"""Push: gather full tensors (FSDP2 shards included) on one rank and send them in buckets.

The path every engine supports: SGLang's ``update_weights_from_tensor`` over HTTP
(``HTTPReceiver``), or any in-process module (``ModuleReceiver``), checked bit for bit after
each update. ``WeightServer`` serves any receiver behind the same endpoints.

Colocated (an SGLang engine on the trainer's GPUs): ``ColocatedReceiver`` sends one payload per
TP rank, CUDA IPC handles on GPU (``serialize_cuda_ipc``, ``open_cuda_ipc``), shared memory on
CPU; ``push.cuda_runtime`` checks and reads the handles with cuda-python
(``pip install 'miles-transfer[cuda]'``).
"""

from miles_transfer.push.colocated import ColocatedReceiver, PayloadGroup, TorchDistGroup
from miles_transfer.push.cuda_ipc import CudaIPCPayload, open_cuda_ipc, serialize_cuda_ipc
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
    "ColocatedReceiver",
    "CudaIPCPayload",
    "HTTPReceiver",
    "ModuleReceiver",
    "PayloadGroup",
    "ReceiverError",
    "SyncReport",
    "TorchDistGroup",
    "WeightMismatchError",
    "WeightServer",
    "bucketize",
    "deserialize_named_tensors",
    "discard_serialized",
    "iter_full_state",
    "open_cuda_ipc",
    "push_module_weights",
    "push_weights",
    "serialize_cuda_ipc",
    "serialize_named_tensors",
]
