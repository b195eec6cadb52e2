"""miles-transfer: move policy weights from a trainer to inference engines, verified bit for bit."""

from miles_transfer._digest import tensor_digest
from miles_transfer._receiver import WeightReceiver
from miles_transfer.version import __version__

__all__ = ["WeightReceiver", "__version__", "tensor_digest"]
