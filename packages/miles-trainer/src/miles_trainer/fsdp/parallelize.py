"""How the policy is laid out: FSDP2 across several ranks, a plain module on one.

Why two layouts: on one rank FSDP2 shards nothing, yet costs its hooks, DTensor dispatch on
every parameter op and a per-tensor AdamW (profiled on the demo policy: AdamW over DTensors
9.8 ms, DTensor dispatch 5.7 ms, hooks about 10 ms per step). With one rank the trainer
therefore keeps the plain HF module and does FSDP2's mixed precision itself
(`MixedPrecisionCopy`), with the same numerics: the forward runs on low-precision casts of the
fp32 master parameters, and each backward's low-precision gradients are upcast and added to
the masters' fp32 gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.func import functional_call

from miles_trainer._hf_dir import check_model_dir

__all__ = ["MixedPrecisionCopy", "apply_fsdp", "cast_frozen_params", "load_model"]


def load_model(path: str, what: str, *, attn_implementation: str, trainable: bool) -> Any:
    """Load an HF causal LM in float32, in eval mode (no dropout).

    Eval mode makes the training forward match the rollout's and the old-logprob pass
    (on-policy ratios start at exactly 1 up to numerics).
    """
    from transformers import AutoModelForCausalLM

    check_model_dir(path, what)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, use_safetensors=True, attn_implementation=attn_implementation
    )
    model.eval()
    if not trainable:
        model.requires_grad_(False)
    return model


def apply_fsdp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    dtype: torch.dtype,
    *,
    reshard_after_forward: bool = True,
) -> None:
    """Shard each decoder layer and the root with FSDP2; low-precision compute if asked."""
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in block_names:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


def cast_frozen_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters (not the buffers: rotary tables stay fp32) of a frozen model.

    For the reference model on one rank: FSDP2 would cast the same parameters at every forward.
    """
    with torch.no_grad():
        for p in model.parameters():
            assert not p.requires_grad
            p.data = p.data.to(dtype)


class MixedPrecisionCopy:
    """Low-precision copies of a module's fp32 parameters to run its forward on (one rank).

    `forward` calls the module with the copies swapped in (``torch.func.functional_call``;
    tied parameters stay tied). After each backward, `accumulate_grads` adds the copies'
    gradients, upcast to float32, to the master parameters' ``.grad`` and clears them: FSDP2's
    ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`` at world size 1 does the
    same per micro-batch. `refresh` re-casts the copies; call it whenever the masters may have
    changed (after an optimizer step or a state-dict load).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self._model = model
        self._masters = dict(model.named_parameters())  # tied parameters appear once
        self._copies = {
            name: torch.empty_like(p, dtype=dtype).requires_grad_(p.requires_grad)
            for name, p in self._masters.items()
        }
        self.refresh()

    def refresh(self) -> None:
        """Cast the current master parameters into the copies."""
        with torch.no_grad():
            for name, p in self._masters.items():
                self._copies[name].copy_(p)

    def forward(self, **kwargs: Any) -> Any:
        """``model(**kwargs)`` computed on the low-precision copies."""
        return functional_call(self._model, self._copies, args=(), kwargs=kwargs)

    def accumulate_grads(self) -> None:
        """Add the copies' gradients (as float32) to the masters' and clear the copies'."""
        with torch.no_grad():
            for name, c in self._copies.items():
                if c.grad is None:
                    continue
                master = self._masters[name]
                if master.grad is None:
                    master.grad = c.grad.to(torch.float32)
                else:
                    master.grad.add_(c.grad)
                c.grad = None


class PlacedModel:
    """A module in its training layout, called the same way whatever the layout.

    - ``sharded``: FSDP2 ``fully_shard`` over ``mesh`` (several ranks), mixed precision by
      FSDP2's policy.
    - plain on ``device`` (one rank), with a `MixedPrecisionCopy` for low-precision compute
      (trainable) or parameters cast once (frozen).
    - ``placement="cpu"``: a plain full copy on the CPU whatever the rank count (a frozen
      reference kept off the accelerator); inputs go to the CPU, outputs come back.

    Args:
        module: the model (float32, on the CPU).
        mesh: the data-parallel mesh.
        dtype: compute dtype.
        device: this rank's device.
        fsdp: the FSDP2 settings (``FSDPConfig``).
        placement: "device" or "cpu".
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        mesh: DeviceMesh,
        dtype: torch.dtype,
        device: torch.device,
        fsdp: Any,
        placement: str = "device",
    ) -> None:
        self.module = module
        self.trainable = any(p.requires_grad for p in module.parameters())
        self._mp: MixedPrecisionCopy | None = None
        self._device = torch.device("cpu") if placement == "cpu" else device
        self._out_device = device
        sharded = placement == "device" and mesh.size() > 1
        if sharded:
            fsdp.build(module, mesh, dtype)
        else:
            module.to(self._device)
            if dtype != torch.float32:
                if self.trainable:
                    self._mp = MixedPrecisionCopy(module, dtype)
                else:
                    cast_frozen_params(module, dtype)

    def __call__(self, **kwargs: Any) -> Any:
        """``module(**kwargs)`` in this layout (tensors moved to the module's device)."""
        if self._device != self._out_device:
            kwargs = {k: v.to(self._device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        if self._mp is not None:
            return self._mp.forward(**kwargs)
        return self.module(**kwargs)

    def refresh(self) -> None:
        """Re-cast low-precision copies after the master weights changed (no-op otherwise)."""
        if self._mp is not None:
            self._mp.refresh()

    def accumulate_grads(self) -> None:
        """Move the low-precision copies' gradients to the fp32 masters (no-op otherwise)."""
        if self._mp is not None:
            self._mp.accumulate_grads()

    def to_output_device(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the rank's compute device (where the loss runs)."""
        return x.to(self._out_device)
