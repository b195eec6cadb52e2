"""Settings only the FSDP2 backend reads (`TrainerConfig.fsdp`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDPConfig"]


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """How FSDP2 lays the policy out across data-parallel ranks.

    With one rank the trainer keeps a plain module and none of these apply (see
    ``fsdp/parallelize.py`` for why).

    Attributes:
        reshard_after_forward: free each layer's all-gathered parameters after its forward
            and gather them again for the backward (FSDP2's default: ZeRO-3 memory); False
            keeps them until the backward (ZeRO-2 style: less communication, more memory).
    """

    reshard_after_forward: bool = True

    def build(self, model: torch.nn.Module, mesh: DeviceMesh, dtype: torch.dtype) -> None:
        """Shard ``model`` in place: each decoder layer and the root with ``fully_shard``."""
        from miles_trainer.fsdp.parallelize import apply_fsdp

        apply_fsdp(model, mesh, dtype, reshard_after_forward=self.reshard_after_forward)
