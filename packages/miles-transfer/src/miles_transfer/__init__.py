"""miles-transfer: move policy weights from a trainer to inference engines, verified bit for bit."""

from miles_transfer._digest import tensor_digest
from miles_transfer._receiver import WeightReceiver
from miles_transfer._wire import (
    deserialize_named_tensors,
    discard_serialized,
    serialize_named_tensors,
)
from miles_transfer.version import __version__

__all__ = [
    "WeightReceiver",
    "__version__",
    "deserialize_named_tensors",
    "discard_serialized",
    "serialize_named_tensors",
    "tensor_digest",
]
