"""Build the tiny Qwen3 policy that the CPU demo and the end-to-end tests train.

Why: Miles must run a real RL loop on a 2-core laptop CPU with no model download. This tool
makes a character-level tokenizer (a real HF fast tokenizer with a Qwen-style chat template),
a tiny Qwen3-architecture model from a config, and briefly supervises it on two-digit addition.

The warm-up leaves room for RL to show: its labels are imperfect the way a careless teacher's
are. On problems whose units digits carry, a share ``carry_noise`` (55%) of the labels forget
the carry (``57+68=115``), so the policy learns to forget it more often than not: its greedy
answers are right on the problems without a units carry and mostly wrong on the others (about
half of all problems), while a right answer is still among its samples. RL with the task's
exact-match reward then has something real to teach: carrying, measured on problems it never
trains on. The warm-up draws only from the task's training partition (``sample``), never from
the held-out problems (``heldout``) the run evaluates on.

The output is a plain HF checkpoint directory (config.json, model.safetensors, tokenizer files)
and is cached: a second call with the same settings returns at once.

Laptop:   python tools/make_tiny_model.py        # ~1-2 min on 2 cores, then cached
Cluster:  not needed; point a recipe's model_path at a real checkpoint instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import string
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=()?.,:!\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(kw_only=True, slots=True)
class TinyModelSpec:
    """What to build. The output directory records it; a different spec rebuilds."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 128
    sft_steps: int = 600
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    sft_label_smoothing: float = 0.05
    carry_noise: float = 0.55
    max_operand: int = 99
    ops: str = "+"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.carry_noise <= 1.0:
            raise ValueError(f"carry_noise must be in [0, 1], got {self.carry_noise}")
        if self.carry_noise and self.ops != "+":
            raise ValueError(f"carry_noise applies to addition only (ops '+'), got {self.ops!r}")


def default_cache_dir() -> Path:
    """``$MILES_CACHE_DIR`` or ``~/.cache/miles``."""
    return Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))


def build_tokenizer():  # type: ignore[no-untyped-def]
    """A character-level HF fast tokenizer with a Qwen-style chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def warmup_answer(item, carry_noise: float, rng: random.Random) -> str:  # type: ignore[no-untyped-def]
    """The warm-up's label for ``a+b=``: the sum, except that a problem whose units digits
    carry gets the sum without that carry (``a + b - 10``) with probability ``carry_noise``."""
    a, b = (int(x) for x in str(item.messages[-1]["content"]).rstrip("=").split("+"))
    forgets = (a % 10) + (b % 10) >= 10 and rng.random() < carry_noise
    return str(a + b - 10 if forgets else a + b)


def _sft_batch(tok, task, n: int, carry_noise: float, rng: random.Random):  # type: ignore[no-untyped-def]
    """Right-padded (input_ids, labels) with loss on the answer and the end-of-turn token."""
    seqs, labels = [], []
    for _ in range(n):
        item = task.make()
        prompt_ids = list(
            tok.apply_chat_template(
                item.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        answer_ids = tok(warmup_answer(item, carry_noise, rng), add_special_tokens=False).input_ids
        ids = prompt_ids + answer_ids + [tok.eos_token_id]
        seqs.append(ids)
        labels.append([-100] * len(prompt_ids) + answer_ids + [tok.eos_token_id])
    width = max(map(len, seqs))
    pad = tok.pad_token_id
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return input_ids, label_ids


def build(spec: TinyModelSpec, out: Path, *, quiet: bool = False) -> Path:
    """Build the model into ``out`` (atomically: a temp dir renamed into place)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miles_rollout.tasks import ArithmeticTask

    torch.manual_seed(spec.seed)
    tok = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    # A different stream from the RL prompts (seed + 1000), so warm-up does not see RL prompts.
    task = ArithmeticTask(max_operand=spec.max_operand, ops=spec.ops, seed=spec.seed + 1000)
    noise_rng = random.Random(spec.seed + 5)  # which carrying problems' labels forget it
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / max(1, spec.sft_steps))
    )
    model.train()
    t0 = time.perf_counter()
    for step in range(spec.sft_steps):
        input_ids, labels = _sft_batch(tok, task, spec.sft_batch_size, spec.carry_noise, noise_rng)
        logits = model(input_ids=input_ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            label_smoothing=spec.sft_label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if not quiet and (step % 50 == 0 or step == spec.sft_steps - 1):
            print(f"  sft step {step:4d}  loss {loss.item():.3f}  {time.perf_counter() - t0:.0f}s")
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "miles_tiny_model.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure(
    spec: TinyModelSpec | None = None, out: Path | None = None, *, quiet: bool = False
) -> Path:
    """Return the model directory for ``spec``, building it first unless it is already there.

    The directory records the spec it was built from; a different spec rebuilds it.
    """
    spec = spec or TinyModelSpec()
    out = out or default_cache_dir() / "tiny-qwen3-arith"
    stamp = out / "miles_tiny_model.json"
    built = (out / "model.safetensors").is_file() and stamp.is_file()
    if built and json.loads(stamp.read_text()) == asdict(spec):
        return out
    return build(spec, out, quiet=quiet)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        type=Path,
        help="output directory (default: $MILES_CACHE_DIR/tiny-qwen3-arith, "
        "MILES_CACHE_DIR defaulting to ~/.cache/miles)",
    )
    # Defaults from an instance: on a slots dataclass the class attribute is a descriptor.
    defaults = TinyModelSpec()
    p.add_argument("--sft-steps", type=int, default=defaults.sft_steps)
    p.add_argument("--label-smoothing", type=float, default=defaults.sft_label_smoothing)
    p.add_argument(
        "--carry-noise",
        type=float,
        default=defaults.carry_noise,
        help="share of carrying problems whose warm-up label forgets the carry",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    spec = TinyModelSpec(
        sft_steps=args.sft_steps,
        sft_label_smoothing=args.label_smoothing,
        carry_noise=args.carry_noise,
        seed=args.seed,
    )
    out = args.out or default_cache_dir() / "tiny-qwen3-arith"
    if args.force:
        build(spec, out, quiet=args.quiet)
    else:
        ensure(spec, out, quiet=args.quiet)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
