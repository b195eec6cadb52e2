"""PPO's critic: an HF transformer backbone with a scalar value head (`ValueModel`)."""

from __future__ import annotations

from typing import Any

import torch

from miles_trainer._hf_dir import check_model_dir

__all__ = ["ValueModel"]


class ValueModel(torch.nn.Module):
    """``V(state)``: the backbone's last hidden state through a linear head to one value.

    The head starts at zero (every value 0 at step 0, so the first advantages are the
    rewards' returns) and is trained with `miles_trainer.losses.value_loss`.

    Args:
        backbone: an HF base model (``AutoModel``): returns ``last_hidden_state``.
    """

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        config: Any = backbone.config
        hidden = int(config.hidden_size)
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        # FSDP2 shards each decoder layer on its own, as for the policy.
        self._no_split_modules = list(getattr(backbone, "_no_split_modules", None) or ())

    @classmethod
    def from_pretrained(
        cls, path: str, what: str = "model_path", *, attn_implementation: str = "sdpa"
    ) -> ValueModel:
        """The backbone of the HF checkpoint at ``path`` (float32, eval mode) plus a zero head.

        Raises:
            FileNotFoundError: ``path`` is not a loadable HF safetensors directory.
        """
        from transformers import AutoModel

        check_model_dir(path, what)
        backbone = AutoModel.from_pretrained(
            path, dtype=torch.float32, use_safetensors=True, attn_implementation=attn_implementation
        )
        model = cls(backbone)
        model.eval()  # no dropout, as the policy
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        logit_pos_BR: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Float32 values ``[B, R]`` at the flat positions ``logit_pos_BR`` (see `MicroBatch`)."""
        out = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden_BLH = out.last_hidden_state
        h_BRH = hidden_BLH.reshape(-1, hidden_BLH.shape[-1])[logit_pos_BR]
        return self.value_head(h_BRH).squeeze(-1).float()
