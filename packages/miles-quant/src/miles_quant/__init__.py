"""miles-quant: bit-exact quantizers under one precision contract.

FP8 (E4M3/E5M2: per tensor, per channel, per-token 1x128, 128x128 blocks), MXFP8 and MXFP4
(1x32, E8M0 scales), NVFP4 (1x16 or 16x16, E4M3 scales + fp32 global scale) and symmetric
INT4 (groups of 32 or 128), in C++ (native, multithreaded) and PyTorch (reference, any device)
that agree bit for bit. The contract: docs/contract.md in the package.

    import miles_quant as mq
    q = mq.quantize(w, "nvfp4")                # backend="auto": C++ on CPU if built
    w_hat = mq.dequantize(q, torch.bfloat16)

Importing never initialises CUDA and never fails when the extension is missing (the PyTorch
reference is used, with a one-time warning).

Submodules: `miles_quant.checkpoint` (quantized HF checkpoints in the layouts engines load;
needs safetensors), `miles_quant.calibrate` (activation amax and static input scales, e.g.
the NVFP4 `input_scale`) and `miles_quant.qat` (INT4 quantization-aware training).
"""

from miles_quant._api import QuantizedTensor, dequantize, quantize
from miles_quant._delayed import DelayedScaler
from miles_quant._layout import (
    pack_fp4,
    pack_int4,
    swizzle_offsets,
    swizzle_scales,
    swizzled_shape,
    unpack_fp4,
    unpack_int4,
    unswizzle_scales,
)
from miles_quant._native import available as native_available
from miles_quant._native import error as native_error
from miles_quant._spec import FORMATS
from miles_quant.version import __version__

__all__ = [
    "FORMATS",
    "DelayedScaler",
    "QuantizedTensor",
    "__version__",
    "dequantize",
    "native_available",
    "native_error",
    "pack_fp4",
    "pack_int4",
    "quantize",
    "swizzle_offsets",
    "swizzle_scales",
    "swizzled_shape",
    "unpack_fp4",
    "unpack_int4",
    "unswizzle_scales",
]
