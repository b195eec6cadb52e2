"""miles-rollout fleet with the SGLang backend on a GPU: start, route, a session, a weight update.

Why: the CPU machines test the fleet with the embedded engine behind the real sglang-router and
only build SGLang's command lines. This check (< 8 minutes, one GPU) runs the real thing:

1. build   two tiny random Qwen3 checkpoints (v0, v1: same shapes, other weights) with a
           character tokenizer and a ChatML chat template; nothing is downloaded.
2. fleet   ``FleetConfig(backend="sglang", engines=N)``: ``python -m sglang.launch_server``
           per engine, sglang-router with manual / min_load / dp-aware, all registered.
3. route   two generate calls with one ``X-SMG-Routing-Key`` through the router (greedy, ids
           and logprobs back, the same engine both times).
4. session the TITO session server in front of the router: two chat turns of one session.
5. update  ``update_weights_from_disk(v1, weight_version="v1")`` on every engine: the version is
           reported and the greedy continuation of a fixed prompt changes.
6. session a third turn of the same session: its generated tokens carry version v1, the
           earlier ones do not.
7. close   every process the fleet started is gone.

Run from the repository root (tools/gpu_checks/sglang_fleet_check.sh sets up the paths):
    PYTHONPATH=packages/miles-rollout/src:packages/miles-transfer/src \\
        python tools/gpu_checks/sglang_fleet_check.py [--engines N] [--model-path DIR]
``--model-path`` serves a real local checkpoint instead of step 1's (then step 5 reloads the
same weights under version v1 and does not require the output to change). ``--dry-run-cpu``
runs every step with the embedded CPU engine instead of SGLang (what the CPU machines do to
keep this script working). Each step prints PASS or FAIL; the exit code is the failure count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import string
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = [5, 6, 7, 8, 9, 10]


def build_checkpoint(path: Path, seed: int) -> Path:
    """A random 2-layer Qwen3 (hidden 256, head_dim 64: SGLang's kernels take it) in bf16 with
    a 128-token character tokenizer and a ChatML template."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    extra = [f"<|x{i}|>" for i in range(128 - len(specials) - len(chars))]
    vocab = {tok: i for i, tok in enumerate(specials + chars + extra)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials + extra)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.15,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(cfg)
    model = model.bfloat16()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Checks:
    """Runs steps in order, prints PASS/FAIL with times, counts failures."""

    def __init__(self) -> None:
        self.failures = 0
        self.t0 = time.monotonic()

    def step(self, name: str, fn: Callable[[], str | None]) -> bool:
        start = time.monotonic()
        try:
            note = fn()
        except Exception as exc:
            self.failures += 1
            print(f"FAIL {name} ({time.monotonic() - start:.1f}s): {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
            return False
        print(f"PASS {name} ({time.monotonic() - start:.1f}s){': ' + note if note else ''}")
        return True


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--model-path", default=None, help="a local HF checkpoint (default: built)")
    p.add_argument("--dry-run-cpu", action="store_true", help="embedded CPU engines, no SGLang")
    p.add_argument("--mem-fraction-static", type=float, default=0.3)
    p.add_argument("--work-dir", default=None)
    args = p.parse_args()

    from miles_rollout import SamplingParams, SGLangClient
    from miles_rollout.fleet import Fleet, FleetConfig
    from miles_rollout.fleet.processes import wait_gone
    from miles_rollout.fleet.router import parse_prometheus
    from miles_rollout.session import serve_sessions

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="sglang-fleet-check-"))
    checks = Checks()
    state: dict[str, Any] = {}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)

    def build() -> str:
        if args.model_path:
            state["v0"] = state["v1"] = Path(args.model_path)
            return f"using {args.model_path}"
        state["v0"] = build_checkpoint(work / "v0", seed=0)
        state["v1"] = build_checkpoint(work / "v1", seed=1)
        return str(work)

    def fleet() -> str:
        cfg = FleetConfig(
            model_path=str(state["v0"]),
            engines=args.engines,
            backend="embedded" if args.dry_run_cpu else "sglang",
            engine_args={"num_threads": 1} if args.dry_run_cpu else {},
            sglang_args={}
            if args.dry_run_cpu
            else {
                "mem_fraction_static": args.mem_fraction_static,
                "skip_server_warmup": True,
                "disable_cuda_graph": True,  # start-up in seconds; graphs are not under test
                "enable_metrics": True,  # per-engine token counters for the route step
            },
            log_dir=str(work / "logs"),
            startup_timeout_s=300,
        )
        started = time.monotonic()
        state["fleet"] = fleet = Fleet(cfg).start()
        workers = len(_get(fleet.url + "/workers")["workers"])
        return f"{fleet.url}, {workers} worker(s), up in {time.monotonic() - started:.0f}s"

    async def _route() -> str:
        fleet: Fleet = state["fleet"]
        before = [await _served(e.url) for e in fleet.engines]
        async with SGLangClient(fleet.url, timeout=300) as c:
            outs = [
                await c.generate(PROMPT, greedy, rid=f"check-{i}", routing_key="gpu-check")
                for i in range(2)
            ]
        after = [await _served(e.url) for e in fleet.engines]
        assert outs[0].output_ids == outs[1].output_ids, "greedy twice, two answers"
        assert outs[0].output_logprobs is not None
        assert len(outs[0].output_logprobs) == 16
        grew = [a - b for a, b in zip(after, before)]
        assert sum(g > 0 for g in grew) == 1, f"not one engine served both turns: {grew}"
        state["greedy_v0"] = outs[0].output_ids
        return f"output {outs[0].output_ids[:8]}..., version {outs[0].weight_version}"

    async def _served(url: str) -> float:
        """Tokens the engine generated, by its own counter: ours in /get_server_info, SGLang's
        ``sglang:generation_tokens_total`` on /metrics (``--enable-metrics``)."""
        async with SGLangClient(url) as c:
            info = await c.get_server_info()
        states = info.get("internal_states") or []
        if states and "num_generated_tokens" in states[0]:
            return float(sum(s["num_generated_tokens"] for s in states))
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            samples = parse_prometheus(resp.read().decode())
        return sum(v for n, _, v in samples if n == "sglang:generation_tokens_total")

    def sessions() -> str:
        handle = serve_sessions(
            state["fleet"].url, model_path=str(state["v0"]), template_family="chatml"
        )
        state["sessions"] = handle
        sid = _post(handle.url + "/sessions", {})["session_id"]
        state["sid"] = sid
        state["messages"] = [{"role": "user", "content": "hi"}]
        for turn in range(2):
            _chat(handle.url, sid, state)
            state["messages"].append({"role": "user", "content": f"turn {turn + 2}"})
        info = _get(f"{handle.url}/sessions/{sid}")
        assert info["num_turns"] == 2, info
        return f"session {sid}: {info['num_tokens']} tokens after 2 turns"

    async def _update() -> str:
        fleet: Fleet = state["fleet"]
        for e in fleet.engines:
            async with SGLangClient(e.url, timeout=300) as c:
                await c.update_weights_from_disk(str(state["v1"]), weight_version="v1")
                assert await c.get_weight_version() == "v1"
        async with SGLangClient(fleet.url, timeout=300) as c:
            out = await c.generate(PROMPT, greedy, routing_key="gpu-check")
        assert out.weight_version == "v1", out.weight_version
        if not args.model_path:
            assert out.output_ids != state["greedy_v0"], "new weights, same greedy output"
        return f"output now {out.output_ids[:8]}..."

    def session_again() -> str:
        handle, sid = state["sessions"], state["sid"]
        _chat(handle.url, sid, state)
        sample = _get(f"{handle.url}/sessions/{sid}/samples")["samples"][-1]
        versions, mask = sample["weight_versions"], sample["loss_mask"]
        generated = [v for v, m in zip(versions, mask) if m]
        assert generated, "no generated tokens in the sample"
        last_turn = generated[-8:]
        assert set(last_turn) == {"v1"}, f"last turn's versions {set(last_turn)}"
        assert "v1" not in generated[:-8], "earlier turns relabelled"
        return f"{len(generated)} generated tokens, versions {sorted(set(generated))}"

    def close() -> str:
        fleet: Fleet = state.pop("fleet")
        if "sessions" in state:
            state.pop("sessions").close()
        pids = fleet.pids
        fleet.close()
        left = wait_gone(pids, 60)
        assert not left, f"still running: {left}"
        return f"{len(pids)} processes stopped"

    ok = checks.step("build", build) and checks.step("fleet", fleet)
    if ok:
        checks.step("route", lambda: asyncio.run(_route()))
        if checks.step("session", sessions):
            checks.step("update", lambda: asyncio.run(_update()))
            checks.step("session-after-update", session_again)
        else:
            checks.step("update", lambda: asyncio.run(_update()))
    if "fleet" in state:
        checks.step("close", close)
    if checks.failures:
        print(f"logs: {work / 'logs'}")
    total = time.monotonic() - checks.t0
    print(
        f"{'FAILED' if checks.failures else 'PASSED'}: {checks.failures} failure(s), {total:.0f}s"
    )
    return checks.failures


def _chat(url: str, sid: str, state: dict[str, Any]) -> None:
    body = {"messages": state["messages"], "max_tokens": 8, "temperature": 0.0}
    out = _post(f"{url}/sessions/{sid}/v1/chat/completions", body)
    message = out["choices"][0]["message"]
    state["messages"].append({"role": "assistant", "content": message.get("content") or ""})


if __name__ == "__main__":
    sys.exit(main())
