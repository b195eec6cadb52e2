"""The AdamW update of one bucket segment: torch's single-tensor AdamW, op for op.

`torch.optim.AdamW(foreach=False, fused=False, capturable=False, amsgrad=False)` runs, per
parameter (``torch/optim/adam.py``, ``_single_tensor_adam`` with decoupled weight decay)::

    step += 1
    param.mul_(1 - lr * weight_decay)                       # when weight_decay != 0
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step                    # Python floats
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)

`adamw_segment` runs exactly these ops on pieces of at most `CHUNK` elements (every op is
elementwise, so cutting changes no bit) with the denominator in a reused scratch buffer, so
temporaries stay bounded and pre-faulted. With bf16 moments they are upcast to fp32 in scratch,
updated with the same ops, and rounded back (round to nearest even).
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "adamw_segment"]

CHUNK = 1 << 22  # elements per piece: 16 MiB of fp32 scratch


def adamw_segment(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    scratch: torch.Tensor,
) -> None:
    """Update flat fp32 ``param`` and the moments in place (``step`` already incremented).

    Args:
        param: fp32 master weights, 1-D CPU.
        grad: gradient of the same length (any float dtype or device; cast to fp32 CPU).
        exp_avg, exp_avg_sq: moments, fp32 or bf16, same length.
        step: the parameter's step count after this update's increment.
        lr, beta1, beta2, eps, weight_decay, maximize: the AdamW hyperparameters.
        scratch: fp32 buffer of at least ``min(len, CHUNK)`` elements (three times that with
            bf16 moments).
    """
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    exact = exp_avg.dtype == torch.float32
    n = param.numel()
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        m = end - start
        p = param[start:end]
        g = grad[start:end]
        if g.dtype != torch.float32 or g.device != p.device:
            g = g.to(device=p.device, dtype=torch.float32)
        if maximize:
            g = -g
        if exact:
            ea, eas = exp_avg[start:end], exp_avg_sq[start:end]
        else:
            ea = scratch[m : 2 * m].copy_(exp_avg[start:end])
            eas = scratch[2 * m : 3 * m].copy_(exp_avg_sq[start:end])
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        ea.lerp_(g, 1 - beta1)
        eas.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = torch.sqrt(eas, out=scratch[:m])
        denom.div_(bias_correction2_sqrt).add_(eps)
        p.addcdiv_(ea, denom, value=-step_size)
        if not exact:
            exp_avg[start:end].copy_(ea)
            exp_avg_sq[start:end].copy_(eas)
