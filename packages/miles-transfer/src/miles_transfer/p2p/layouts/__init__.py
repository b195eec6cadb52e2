"""Layouts: which box of which HF parameter each rank of a trainer or an engine holds.

One file per implementation: ``fsdp`` (FSDP2 Shard(0)), ``megatron`` (TP/PP/DP/EP),
``sglang`` (engine TP/EP/DP), ``models`` (the Qwen3 parameter set, replicated and split
layouts of any model); ``base`` is the vocabulary (``Layout``, ``LocalTensor``, ``Piece``).
"""

from miles_transfer.p2p.layouts.base import (
    Layout,
    LocalTensor,
    ParamSpec,
    Piece,
    RankLayout,
    materialize,
)
from miles_transfer.p2p.layouts.fsdp import fsdp_layout, shard_dim0
from miles_transfer.p2p.layouts.megatron import megatron_layout
from miles_transfer.p2p.layouts.models import (
    ModelShape,
    qwen3_params,
    replicated_layout,
    split_layout,
)
from miles_transfer.p2p.layouts.sglang import sglang_layout

__all__ = [
    "Layout",
    "LocalTensor",
    "ModelShape",
    "ParamSpec",
    "Piece",
    "RankLayout",
    "fsdp_layout",
    "materialize",
    "megatron_layout",
    "qwen3_params",
    "replicated_layout",
    "sglang_layout",
    "shard_dim0",
    "split_layout",
]
