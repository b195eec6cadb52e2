"""Standalone disk-delta updates: a plain PyTorch loop trains an HF model; an engine follows it.

Why this exists: miles-transfer must be usable alone inside another RL stack. This script is
that situation in miniature, with nothing from Miles but ``miles-transfer[delta]``:

1. the trainer (a plain ``transformers`` causal LM and a plain AdamW loop) publishes its
   weights after every step with ``DeltaPublisher``: ``weight_v{N:06d}/`` directories holding
   only the bf16 elements that changed (a full snapshot every ``--full-every`` versions);
2. the engine host pulls each version with ``DeltaSubscriber`` (applying the delta to its last
   local checkpoint, checksums verified), and the engine reloads it the way SGLang does:
   ``/pause_generation``, ``/update_weights_from_disk``, ``/continue_generation``. Here the
   engine is a bf16 copy of the model behind ``WeightServer``, which speaks SGLang's HTTP API;
   point ``HTTPReceiver`` at a real SGLang server on the engine host instead;
3. every update is verified bit for bit: the engine's per-tensor digests must equal the
   trainer's weights cast to bf16.

Run it (CPU, about half a minute on a laptop)::

    pip install torch==2.13.0 'packages/miles-transfer[delta]' transformers
    python packages/miles-transfer/examples/standalone_delta.py [--steps 10] [--lr 1e-6]

``--model-path DIR`` trains a local HF checkpoint instead of a tiny Qwen3 made from a config.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from miles_transfer import (
    DeltaPublisher,
    DeltaSubscriber,
    HTTPReceiver,
    ModuleReceiver,
    tensor_digest,
)
from miles_transfer.delta import update_engine_via_disk
from miles_transfer.push import WeightServer


def build_model(model_path: str | None) -> torch.nn.Module:
    """A local HF checkpoint, or a tiny Qwen3 from a config (random init, no download)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if model_path:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-6, help="an RL-scale learning rate")
    parser.add_argument("--full-every", type=int, default=5)
    parser.add_argument("--model-path", help="a local HF checkpoint directory")
    parser.add_argument("--workdir", help="where versions are published and pulled")
    args = parser.parse_args()

    policy = build_model(args.model_path)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    vocab = policy.config.vocab_size
    g = torch.Generator().manual_seed(0)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="standalone_delta_"))
    config = {"config.json": policy.config.to_json_string().encode()}
    pub = DeltaPublisher(work / "published", full_every=args.full_every, other_files=config)
    sub = DeltaSubscriber(work / "published", work / "engine_host")

    # Version 0: the engine starts from the first published snapshot.
    pub.publish(policy.state_dict().items())
    sub.pull()
    engine_model = build_model(args.model_path).to(torch.bfloat16)
    engine_model.load_state_dict({n: t.to(torch.bfloat16) for n, t in policy.state_dict().items()})
    with WeightServer(ModuleReceiver(engine_model)) as server:
        engine = HTTPReceiver(server.url)  # the engine's SGLang-style HTTP API
        print(f"{'step':>4} {'loss':>7} {'changed':>8} {'payload':>8} {'pause':>8}  update")
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, vocab, (8, 32), generator=g)
            loss = policy(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()

            published = pub.publish(policy.state_dict().items())
            served = sub.version
            assert served is not None
            version_dir = published.path if published.kind == "delta" else published.path / "delta"
            report = update_engine_via_disk(
                engine,
                sub.path(served),
                version_dir,
                sub.local_root / published.path.name,
            )
            want = {n: tensor_digest(t.to(torch.bfloat16)) for n, t in policy.state_dict().items()}
            assert engine.weights_checksum(list(want)) == want, "engine weights differ"
            assert server.receiver.weight_version == str(step)  # type: ignore[attr-defined]
            d = published.delta
            assert d is not None
            print(
                f"{step:>4} {loss.item():>7.4f} {100 * d.changed_fraction:>7.2f}% "
                f"{100 * d.payload_fraction:>7.2f}% {1e3 * report.pause_seconds:>6.1f}ms  "
                f"{published.kind} v{published.version}, engine weights verified bit-exact"
            )
            sub.prune()  # keep the served version and the one before it
    print(
        f"{args.steps} steps: every delta update verified bit-exact on the engine "
        f"(published under {work / 'published'})"
    )


if __name__ == "__main__":
    main()
