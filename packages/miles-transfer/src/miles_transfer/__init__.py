"""miles-transfer: move policy weights from a trainer to inference engines, verified bit for bit.

Depends on torch and the standard library only, so it installs alone into any RL stack.
"""

from miles_transfer._delta import (
    DeltaBaseError,
    DeltaReport,
    MaterializeReport,
    encode_delta,
    materialize_delta,
)
from miles_transfer._delta_apply import VerifyReport, apply_delta, recover_target, verify_delta
from miles_transfer._delta_engine import (
    DiskReloadEngine,
    EngineUpdateReport,
    PausableEngine,
    update_engine_from_delta,
    update_engine_via_disk,
)
from miles_transfer._delta_publish import (
    DeltaPublisher,
    DeltaSubscriber,
    PublishReport,
    PullReport,
    version_dir_name,
)
from miles_transfer._digest import tensor_digest
from miles_transfer._http import HTTPReceiver, ReceiverError
from miles_transfer._module_receiver import ModuleReceiver
from miles_transfer._push import (
    DEFAULT_BUCKET_BYTES,
    SyncReport,
    WeightMismatchError,
    push_module_weights,
    push_weights,
)
from miles_transfer._receiver import WeightReceiver
from miles_transfer._safetensors import iter_safetensors, save_safetensors
from miles_transfer._server import WeightServer
from miles_transfer._state import bucketize, iter_full_state
from miles_transfer._wire import (
    deserialize_named_tensors,
    discard_serialized,
    serialize_named_tensors,
)
from miles_transfer.version import __version__

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DeltaBaseError",
    "DeltaPublisher",
    "DeltaReport",
    "DeltaSubscriber",
    "DiskReloadEngine",
    "EngineUpdateReport",
    "HTTPReceiver",
    "MaterializeReport",
    "ModuleReceiver",
    "PausableEngine",
    "PublishReport",
    "PullReport",
    "ReceiverError",
    "SyncReport",
    "VerifyReport",
    "WeightMismatchError",
    "WeightReceiver",
    "WeightServer",
    "__version__",
    "apply_delta",
    "bucketize",
    "deserialize_named_tensors",
    "discard_serialized",
    "encode_delta",
    "iter_full_state",
    "iter_safetensors",
    "materialize_delta",
    "push_module_weights",
    "push_weights",
    "recover_target",
    "save_safetensors",
    "serialize_named_tensors",
    "tensor_digest",
    "update_engine_from_delta",
    "update_engine_via_disk",
    "verify_delta",
    "version_dir_name",
]
