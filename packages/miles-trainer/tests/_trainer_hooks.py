"""User hooks named by dotted path in the tests ("_trainer_hooks:reinforce_loss", ...).

They receive the small typed contexts of miles-trainer, as a user's own functions would.
"""

from __future__ import annotations

import torch

from miles_trainer import AdvantageContext, GroupView, LossContext


def reinforce_loss(ctx: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain REINFORCE, ``-scale * A * logp`` per token, plus a per-token metric."""
    scale = float(ctx.params.get("scale", 1.0))
    return -scale * ctx.advantages_BT * ctx.logp_BT, {"neg_adv": (ctx.advantages_BT < 0).float()}


def nan_loss(ctx: LossContext) -> torch.Tensor:
    """A broken loss: NaN on every token (the gradient is NaN too)."""
    return ctx.logp_BT * float("nan")


def wrong_shape_loss(ctx: LossContext) -> torch.Tensor:
    """A broken loss: one value per sequence instead of per token."""
    return ctx.logp_BT.sum(dim=-1)


def constant_advantage(ctx: AdvantageContext) -> list[float]:
    """Every sample gets ``params["value"]``."""
    return [float(ctx.params["value"])] * len(ctx.rewards)


def position_advantage(ctx: AdvantageContext) -> list[list[float]]:
    """Per token: the token's position in the response (0, 1, 2, ...)."""
    return [[float(t) for t in range(n)] for n in ctx.response_lengths]


def keep_even_groups(group: GroupView) -> bool:
    """Keep the groups with an even id."""
    return group.group_id % 2 == 0


def not_a_bool(group: GroupView) -> int:
    """A broken filter: returns an int."""
    return 1


NOT_CALLABLE = 3
