"""miles-offload: AdamW with optimizer state in CPU memory or on node-local NVMe.

`AdamW` keeps fp32 master weights and both moments per bucket, in RAM (``offload="cpu"``) or
in per-bucket files streamed through an io_uring pager (``offload="nvme"``), and updates
exactly like ``torch.optim.AdamW(foreach=False)``. `Pager` is the pager itself.
"""

from miles_offload._adamw import OFFLOAD_TARGETS, AdamW
from miles_offload._format import FORMAT_VERSION, CorruptStateError
from miles_offload._native import available as native_available
from miles_offload._pager import ALIGN, HUGE_PAGE, Pager, aligned_empty, crc32c, open_direct
from miles_offload._store import POOL_BUFFERS
from miles_offload.version import __version__

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "HUGE_PAGE",
    "OFFLOAD_TARGETS",
    "POOL_BUFFERS",
    "AdamW",
    "CorruptStateError",
    "Pager",
    "__version__",
    "aligned_empty",
    "crc32c",
    "native_available",
    "open_direct",
]
