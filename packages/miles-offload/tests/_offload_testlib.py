"""Shared helpers: a fixed set of parameters, gradients per step, and the torch reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# Odd sizes: segments cut inside parameters at offsets that are not multiples of the vector width.
SHAPES: list[tuple[int, ...]] = [(37, 53), (1000,), (3,), (257, 129), (5000,), (1,), (64, 65)]
HYPER: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
TINY_BUCKET_MB = 0.05  # ~4.4k elements per bucket: many buckets, most parameters split


def make_params(shapes: Sequence[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def set_grads(params: list[torch.Tensor], step: int, *, skip: Sequence[int] = ()) -> None:
    """Deterministic gradients for ``step``; parameters in ``skip`` get none (grad None)."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g) * (i + 1)
        p.grad = None if i in skip else grad


def skip_for(step: int) -> tuple[int, ...]:
    """Parameters without a gradient at ``step`` (exercises torch's per-parameter steps)."""
    return (2, 5) if step % 3 == 1 else ()


def run(
    params: list[torch.Tensor],
    opt: torch.optim.Optimizer,
    steps: range,
    hook: Callable[[int], None] | None = None,
) -> None:
    for k in steps:
        set_grads(params, k, skip=skip_for(k))
        opt.step()
        opt.zero_grad()
        if hook is not None:
            hook(k)


def reference(steps: int, *, foreach: bool = False, **hyper: Any) -> tuple[list, dict]:
    """Parameters and state dict of torch.optim.AdamW after ``steps`` steps."""
    params = make_params()
    opt = torch.optim.AdamW(params, **{**HYPER, **hyper}, foreach=foreach)
    run(params, opt, range(steps))
    return [p.detach().clone() for p in params], opt.state_dict()


def assert_same_state(got: dict, want: dict) -> None:
    """Bit-for-bit equality of params-independent AdamW state (step, exp_avg, exp_avg_sq)."""
    assert got["state"].keys() == want["state"].keys()
    for i, w in want["state"].items():
        g = got["state"][i]
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert g[name].dtype == w[name].dtype, (i, name)
            assert torch.equal(g[name], w[name]), (i, name)
    for g, w in zip(got["param_groups"], want["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay", "params"):
            assert tuple(g[key]) == tuple(w[key]) if key == "betas" else g[key] == w[key]


def assert_same_params(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.detach(), w), f"parameter {i} differs"
