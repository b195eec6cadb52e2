"""Convert a Hugging Face checkpoint into a quantized layout an inference engine loads.

Why: low-precision rollout serves exactly what the trainer's weights quantize to under the
miles-quant precision contract. This tool writes those bits in the checkpoint layout each
engine reads, keeps the layers the precision contract says stay in BF16, and can turn a
quantized checkpoint back into a plain one (to check it, or for an engine without the kernels).

Formats and layouts:
    fp8_block128   DeepSeek FP8 (weight E4M3 + weight_scale_inv, 128x128 blocks)
    nvfp4          ModelOpt NVFP4 (weight, weight_scale, weight_scale_2, input_scale)
    mxfp4          gpt-oss MXFP4 (*_blocks, *_scales E8M0)
    int4_g32/_g128 compressed-tensors W4A16 pack-quantized (weight_packed, weight_scale, ...)

Laptop (CPU, a tiny model from tools/make_tiny_model.py or any HF safetensors dir):
    python tools/quantize_checkpoint.py MODEL_DIR OUT_DIR -f int4_g128 --only '*.experts.*'
    python tools/quantize_checkpoint.py MODEL_DIR OUT_DIR -f nvfp4 --keep-first-layers 1 \
        --keep-last-layers 1 --keep '*.self_attn.*' --dry-run
    python tools/quantize_checkpoint.py MODEL_DIR OUT_DIR -f nvfp4 --calib-data prompts.jsonl \
        --calib-samples 128       # NVFP4 input_scale calibrated by running the model (CPU)
    python tools/quantize_checkpoint.py OUT_DIR PLAIN_DIR --dequantize --dtype bfloat16
Cluster: the same command on the node that holds the checkpoint; it streams tensor by
tensor (one tensor, or one fused q/k/v or gate/up group for NVFP4, in memory at a time) and
uses every CPU thread (--threads). Installed packages also have it as `miles-quant-checkpoint`.

Exit status 0 on success, 2 on bad input (the message says what to change); the output
directory appears atomically, so a failed run leaves nothing behind.
"""

from __future__ import annotations

import sys

from miles_quant.checkpoint_cli import main

if __name__ == "__main__":
    sys.exit(main())
