"""Transports: one rank's endpoint of a P2P transfer group (``miles_transfer.protocols.Transport``).

One file per implementation: ``local`` (threads of one process), ``shm`` (same host, /dev/shm),
``socket`` (TCP, any hosts), ``dist`` (torch.distributed: gloo, NCCL), ``mooncake`` (RDMA
through Mooncake's transfer engine, extra ``[mooncake]``).
"""

from miles_transfer.p2p.transports.base import TransportError
from miles_transfer.p2p.transports.dist import TorchDistributedTransport
from miles_transfer.p2p.transports.local import InProcessHub, InProcessTransport
from miles_transfer.p2p.transports.mooncake import MooncakeTransport, mooncake_available
from miles_transfer.p2p.transports.shm import ShmTransport
from miles_transfer.p2p.transports.socket import TcpTransport
from miles_transfer.protocols import Transport

__all__ = [
    "InProcessHub",
    "InProcessTransport",
    "MooncakeTransport",
    "ShmTransport",
    "TcpTransport",
    "TorchDistributedTransport",
    "Transport",
    "TransportError",
    "mooncake_available",
]
