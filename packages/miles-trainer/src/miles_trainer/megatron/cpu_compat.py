"""What megatron-core needs to train on a machine without CUDA (gloo process groups, CPU tensors).

megatron-core is written for CUDA: a few of its helpers allocate on ``torch.cuda.current_device()``
or ``device="cuda"`` unconditionally, and its training glue (gradient buffers, the distributed
optimizer, gradient clipping, the pipeline schedules) checks ``param.type()`` against
``"torch.cuda.FloatTensor"``. None of it needs a GPU to compute. This module bends exactly those
spots, and only when CUDA is absent (`install` is not called on a GPU machine; `cpu_scope` is a
no-op there), so the GPU path runs megatron-core unchanged:

- the global memory buffer (attention scores, sequence-parallel gathers) allocates on the CPU;
- the CUDA RNG tracker is megatron's own inference tracker, whose ``fork`` is a no-op context
  (dropout is off in RL training, and initialisation is replaced by the HF weights);
- `RotaryEmbedding.get_emb` keeps its frequencies on the CPU instead of moving them to CUDA;
- `cpu_scope` (entered around megatron's DDP, optimizer and schedule calls, not around the
  model's own forward) makes ``torch.cuda.synchronize()`` a no-op (after the pipeline's gloo
  send/recv), maps ``torch.cuda.current_device()`` and ``device="cuda"`` factory
  arguments to the CPU, makes ``Tensor.cuda()`` the identity and reports float tensors'
  ``type()`` under their CUDA names, which is what those type checks compare against.

`quiet_cuda_only_hints` (called by `install`) drops megatron's advice to set
``CUDA_DEVICE_MAX_CONNECTIONS=1``, a CUDA scheduling hint with no meaning on the CPU.

`define_missing_te_names` is not about CUDA: megatron-core 0.16.1's MoE router reads the
module global ``te_general_gemm``, which its ``moe_utils`` defines only when Transformer Engine
imports, so without TE every MoE forward raised ``NameError``; it is defined as None there
(the router's own fallback), on any device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "cpu_scope",
    "define_missing_te_names",
    "install",
    "needs_cpu_compat",
    "outside_cpu_scope",
    "quiet_cuda_only_hints",
    "quiet_megatron",
]

_CPU = torch.device("cpu")
_lock = threading.Lock()
_installed = False


def needs_cpu_compat() -> bool:
    """True where megatron-core must run without CUDA."""
    return not torch.cuda.is_available()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Redirect CUDA placements made by megatron's glue code to the CPU."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name: str = func(*args)
            # megatron checks float params against "torch.cuda.FloatTensor" and friends.
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """Silence what megatron-core 0.16.1 warns on every import, build and step in torch 2.13,
    on any device: its fallbacks without Apex / Transformer Engine (the path this backend
    takes on purpose), its own deprecation notices (process groups it looks up itself, old
    module paths), torch's deprecated collective names it calls, and ``.grad`` reads on the
    distributed optimizer's shard views. None says anything about this run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.")
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single")
        warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not")
        warnings.filterwarnings("ignore", message=r"full scope is deprecated")
        warnings.filterwarnings("ignore", message=r"(?s).*custom_layers\.transformer_engine")
        warnings.filterwarnings("ignore", message=r"(?s).*requires ffn_hidden_size")
        warnings.filterwarnings("ignore", message=r"(?s).*dynamic_context\.py")
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated")
        yield


# megatron-core's TP linear layers ask, once per process, for CUDA_DEVICE_MAX_CONNECTIONS=1: a
# CUDA hint (one hardware queue, so a TP collective is scheduled before the compute it should
# overlap). On the CPU there are no CUDA streams and the hint means nothing; on a GPU it stays.
_CUDA_ONLY_HINT = (
    r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
    r"environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1"
)


def quiet_cuda_only_hints() -> None:
    """Ignore, for the whole process, megatron-core's ``CUDA_DEVICE_MAX_CONNECTIONS`` advice
    (its exact messages, as ``UserWarning`` from its tensor-parallel layers); every other
    warning still shows. Called by `install`, so only without CUDA."""
    warnings.filterwarnings(
        "ignore",
        message=_CUDA_ONLY_HINT,
        category=UserWarning,
        module=r"megatron\.core\.tensor_parallel\.layers",
    )


def _import_megatron() -> None:
    """Import megatron-core (and its modules that warn at import) quietly, or fail with the
    install command; every module of this backend imports this one first."""
    with quiet_megatron():
        try:
            for name in (
                "megatron.core",
                "megatron.core.optimizer",
                "megatron.core.distributed",
                "megatron.core.models.gpt.gpt_layer_specs",
                "megatron.core.models.gpt.gpt_model",
            ):
                importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not exc.name.startswith("megatron"):
                raise
            raise ImportError(
                "the Megatron backend needs megatron-core: pip install 'miles-trainer[megatron]'"
            ) from exc


_import_megatron()


def _cpu_current_device() -> torch.device:
    return _CPU


def _no_sync(device: Any = None) -> None:
    """CPU work is done when the call returns: nothing to wait for."""


@contextlib.contextmanager
def cpu_scope() -> Iterator[None]:
    """Run megatron-core glue (DDP, optimizer, schedules) on the CPU; a no-op with CUDA."""
    if not needs_cpu_compat():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _no_sync  # pipeline send/recv waits on CUDA after gloo returns
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


@contextlib.contextmanager
def outside_cpu_scope() -> Iterator[None]:
    """Suspend `cpu_scope`'s torch-function mode (the model's forward does not need it and
    would pay a Python call per op); a no-op with CUDA or outside the scope."""
    if not needs_cpu_compat():
        yield
        return
    from torch.overrides import _get_current_function_mode_stack

    modes = _get_current_function_mode_stack()
    if not any(isinstance(m, _CudaToCpu) for m in modes):
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


class _CpuMemoryBuffer:
    """megatron's `GlobalMemoryBuffer` with its tensors on the CPU (same reuse rule)."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: Any,
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], Any] | None = None,
    ) -> torch.Tensor:
        n = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=_CPU)
            self.buffer[(name, dtype)] = buf
        return buf[:n].view(*tensor_shape)


def define_missing_te_names() -> None:
    """Give megatron's MoE utilities the ``te_general_gemm = None`` they expect without TE."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install() -> None:
    """Apply the CPU adaptations (see the module docstring). Call after
    ``parallel_state.initialize_model_parallel``; idempotent; a no-op with CUDA."""
    global _installed
    if not needs_cpu_compat():
        return
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    quiet_cuda_only_hints()  # a process-wide filter: the hints come from the model's forward
    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    with _lock:
        if _installed:
            return
        original = RotaryEmbedding.get_emb

        @functools.wraps(original)
        def get_emb(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            saved = torch.cuda.current_device
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
            try:
                out: torch.Tensor = original(self, *args, **kwargs)
                return out
            finally:
                torch.cuda.current_device = saved

        RotaryEmbedding.get_emb = get_emb
        _installed = True
