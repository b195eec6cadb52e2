"""A chat template for the tiny test checkpoints (conftest.py builds them without one)."""

from __future__ import annotations

import shutil
from pathlib import Path

# ChatML, as tools/make_tiny_model.py writes for the demo policy.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_chat_template(model_dir: Path, dest: Path) -> Path:
    """Copy a tiny checkpoint to ``dest`` and give its tokenizer the ChatML template."""
    shutil.copytree(model_dir, dest)
    (dest / "chat_template.jinja").write_text(CHATML)
    return dest
