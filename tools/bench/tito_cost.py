"""TITO per-turn cost vs re-rendering and re-tokenizing the whole history, as it grows to 32k.

Why: a session server that speaks chat messages must turn each new request into token ids. The
message-level way (the peer here) renders the chat template over the whole history and
tokenizes all of it every turn: O(history). TITO keeps the stored ids, checks the history is
append-only, and renders and tokenizes only the appended messages: O(new tokens). This script
grows one tool-using conversation (assistant turns of ~150 tokens with a tool call, tool
results of ~300 tokens) to 32k tokens and, at each size, times one more turn both ways with
the real tokenizers (SmolLM2-135M-Instruct's and the Qwen vocabulary with the Qwen3 template):

- TITO: ``Trajectory.plan`` (append-only check over every stored message, render of the
  appended messages against the stand-in history, tokenization of that suffix) + ``commit``.
- peer: ``render(whole history + gen prompt)`` + ``encode`` (what ``apply_chat_template(...,
  tokenize=True)`` costs).

It also checks that both give the same ids (the conversation's assistant ids are canonical
tokenizations, so there is no drift to hide a difference). Medians of ``--repeat`` runs.

Laptop:   python tools/bench/tito_cost.py                 # ~1-2 min on 2 cores
          python tools/bench/tito_cost.py --tokenizers qwen3 --repeat 9
Cluster:  the same; nothing here uses a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string", "description": "the command"}},
                "required": ["cmd"],
            },
        },
    }
]
WORDS = [
    "the", "file", "list", "shows", "build", "output", "and", "a", "test", "log", "with",
    "three", "failures", "in", "module", "parser", "line", "column", "error", "expected",
    "token", "found", "identifier", "while", "reading", "config", "value", "path", "directory",
    "python", "import", "function", "returns", "none", "instead", "of", "string",
]  # fmt: skip


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _assistant(rng: random.Random, i: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": _text(rng, 100),
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "run", "arguments": json.dumps({"cmd": f"cat f{i}.txt"})},
            }
        ],
    }


def _tool(rng: random.Random, i: int) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": _text(rng, 250)}


def _median_s(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(name: str, tokenizer: Any, repeat: int) -> list[dict[str, Any]]:
    from miles_rollout.session.render import TitoRenderer
    from miles_rollout.session.trajectory import Trajectory

    renderer = TitoRenderer(tokenizer)
    rng = random.Random(0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Find why the tests fail."},
    ]
    traj = Trajectory(renderer=renderer)
    rows = []
    i = 0

    template = renderer.template_for(TOOLS)

    def generated_ids(reply: dict[str, Any]) -> list[int]:
        # What the model would have generated for this reply (canonical ids, no drift).
        user = {"role": "user", "content": "u"}
        text = renderer.render([user, reply], TOOLS, template=template, add_generation_prompt=False)
        head = renderer.render([user], TOOLS, template=template, add_generation_prompt=True)
        body = text[len(head) :]
        return renderer.encode(body[: len(body) - len(renderer.family.turn_sep)])

    def turn(reply: dict[str, Any]) -> None:
        plan = traj.plan(messages, TOOLS)
        ids = generated_ids(reply)
        traj.commit(
            plan, output_ids=ids, logprobs=[0.0] * len(ids), weight_versions=["0"] * len(ids),
            reply=reply, finish_reason="stop",
        )  # fmt: skip

    for size in SIZES:
        while len(traj.tokens) < size:
            reply = _assistant(rng, i)
            turn(reply)
            messages += [reply, _tool(rng, i)]
            i += 1
        # One more turn both ways, from the same state (restored after each TITO run).
        snapshot = (list(traj.tokens), len(traj.turns))

        def tito(msgs: list[dict[str, Any]] = messages) -> None:
            traj.input_ids(traj.plan(msgs, TOOLS))

        def full(msgs: list[dict[str, Any]] = messages) -> None:
            renderer.first_turn(msgs, TOOLS, traj.template)

        t_tito = _median_s(tito, repeat)
        t_full = _median_s(full, repeat)
        plan = traj.plan(messages, TOOLS)
        same = traj.input_ids(plan) == renderer.first_turn(messages, TOOLS, traj.template)
        assert (list(traj.tokens), len(traj.turns)) == snapshot
        rows.append(
            {
                "tokenizer": name,
                "history_tokens": len(traj.tokens),
                "new_tokens": len(plan.prompt_ids),
                "tito_ms": t_tito * 1e3,
                "full_ms": t_full * 1e3,
                "ratio": t_full / t_tito,
                "same_ids": same,
            }
        )
        print(
            f"{name:8s} history {len(traj.tokens):6d} tok, new {len(plan.prompt_ids):4d}: "
            f"TITO {t_tito * 1e3:7.2f} ms, full re-render+tokenize {t_full * 1e3:8.2f} ms, "
            f"{t_full / t_tito:6.1f}x, same ids: {same}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", nargs="+", default=["smollm2", "qwen3"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from miles_rollout.models import qwen3_tokenizer_dir, smollm2_dir

    dirs = {
        "smollm2": lambda: smollm2_dir(weights=False),
        "qwen3": qwen3_tokenizer_dir,
    }
    rows = []
    for name in args.tokenizers:
        tokenizer = AutoTokenizer.from_pretrained(dirs[name]())
        rows += bench(name, tokenizer, args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
