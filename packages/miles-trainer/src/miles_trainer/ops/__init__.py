"""The trainer's own forward/backward ops for HF Llama/Qwen models on CPU.

Each op computes HF's forward bit for bit (tested against transformers' modules) with a
backward written out instead of autograd's op-by-op one: on CPU the elementwise passes and
copies autograd adds around the GEMMs were a third of a bf16 train step; and rows that repeat
a prefix (a GRPO group's prompt) compute it once, which cuts the GEMMs themselves.

- `rmsnorm`: HF's RMSNorm (torch's fused kernel forward, a shorter backward).
- `attention`: causal GQA attention with HF's eager maths (``attn_implementation``).
- `rope`: the rotary embedding in fewer passes, and its gradient.
- `attention_block`: q/k/v projections, q/k norms and RoPE as one autograd function.
- `shared_prefix`: rows that share a prefix (a GRPO group's prompt) compute it once.

`use_fast_ops` installs them on a model (instance ``forward``s only: FSDP2's hooks and
``torch.func.functional_call`` see the same modules and parameters).
"""

from __future__ import annotations

import torch

from miles_trainer.ops.attention import GQA_EAGER, attn_implementation
from miles_trainer.ops.attention_block import use_fast_attention_block
from miles_trainer.ops.rmsnorm import use_fast_rms_norm
from miles_trainer.ops.shared_prefix import use_shared_prefix

__all__ = ["GQA_EAGER", "attn_implementation", "use_fast_ops"]


def use_fast_ops(model: torch.nn.Module) -> dict[str, int]:
    """Install the fused ops on ``model`` (an HF causal LM); return how many modules each took.

    RMSNorms always; attention blocks when the model attends with the trainer's GQA eager
    attention (`attn_implementation` for bf16/fp16 on CPU) or HF's SDPA (float32), and then
    the shared-prefix forward of the decoder stack. Call it after
    any forward hooks (QAT) are registered; a module whose projections carry hooks keeps HF's
    forward for that call.
    """
    counts = {
        "rms_norm": use_fast_rms_norm(model),
        "attention": use_fast_attention_block(model),
    }
    counts["shared_prefix"] = use_shared_prefix(model) if counts["attention"] else 0
    return counts
