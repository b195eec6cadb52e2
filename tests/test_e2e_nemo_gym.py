"""NeMo Gym both ways round, with nemo-gym 0.4.0 in its own Python (3.12) behind miles_env's
bridge:

- under ``miles train``: ``task.name: nemo_gym`` reads NeMo Gym's JSONL task rows and names
  the resources server, ``rollout.agent: miles_env.integrations.nemo_gym:nemo_gym_agent`` plays
  each row with NeMo Gym's own ``simple_agent`` (``POST /run``: ``/seed_session``, its
  Responses loop, tools on the resources server, ``/verify``), whose ``openai_model`` model
  server calls the run's TITO session's ``/v1/responses`` as it would call any provider; the
  session keeps the token ids and the loss mask, ``/verify``'s reward is the sample's, and the
  samples are trained (`NemoGymAgent`, `miles.agentic.NemoGymTaskSet`);
- Miles' episode driver as the agent on the same resources server (`NemoGymEnv`).

The resources server is the add task of miles-env's tests (``tests/frameworks/
nemo_gym_server.py``: a real ``SimpleResourcesServer``, served in the bridge). The model is a
tiny random Llama with SmolLM2's tokenizer and ChatML template; a tiny random model writes no
tool calls, so the turns named in a script are written as the model would write them
(tokenized and returned as the engine's output, as ``miles.agentic.scripted`` does) and the
others are the engine's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from conftest import REPO, save_tiny_smol

pytest.importorskip("miles_env")

from miles_env.environment import run_episode
from miles_env.integrations.nemo_gym import (
    NemoGymAgent,
    NemoGymBridge,
    NemoGymEnv,
    nemo_gym_python,
)

SERVER = REPO / "packages" / "miles-env" / "tests" / "frameworks" / "nemo_gym_server.py"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call>'
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    "strict": False,
}
ROW = {
    "id": "add-20-22",
    "responses_create_params": {
        "input": [{"role": "user", "content": "What is 20 + 22? Use the add tool."}],
        "tools": [ADD],
    },
    "a": 20,
    "b": 22,
}
# The three episodes of the group, by the order their sessions first generate: solved; the
# call, then the engine's own reply; three calls whose outputs overflow the context.
SCRIPTS = [[CALL, "The sum is 42."], [CALL], ["\n".join([CALL] * 3)]]


class _Scripted:
    """The run's engine client: a session's scripted turns (`SCRIPTS`, handed out in the order
    sessions first generate) are returned as generated (logprob 0, cut at the request's
    ``max_new_tokens`` as an engine cuts), the rest are the engine's."""

    scripts: ClassVar[dict[str, list[str]]] = {}
    tokenizer: ClassVar[Any] = None

    def __init__(self, engine: Any) -> None:
        from miles_rollout import LocalEngineClient

        self._inner = LocalEngineClient(engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def __aenter__(self) -> _Scripted:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.__aexit__(*exc)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Any = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        routing_key: str | None = None,
        **extra: Any,
    ) -> Any:
        from miles_rollout import FinishReason, GenerateOutput

        key = str(routing_key)
        if key not in self.scripts:
            self.scripts[key] = list(SCRIPTS[len(self.scripts)])
        script = self.scripts[key]
        if not script:
            return await self._inner.generate(
                input_ids, sampling_params, return_logprob=return_logprob, rid=rid,
                routing_key=routing_key, **extra,
            )  # fmt: skip
        end = self.tokenizer.eos_token_id
        ids = [*self.tokenizer.encode(script.pop(0), add_special_tokens=False), end]
        finish = FinishReason(type="stop", matched=end)
        limit = getattr(sampling_params, "max_new_tokens", None)
        assert limit is None or len(ids) <= limit, (len(ids), limit)  # the script fits
        version = await self._inner.get_weight_version()
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[0.0] * len(ids),
            finish_reason=finish,
            weight_version=version,
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            rid=rid or key,
            output_weight_versions=[version] * len(ids),
        )


@pytest.fixture(scope="module")
def nemo_gym() -> Iterator[Any]:
    """The bridge in NeMo Gym's Python (``.bridge``) and its event loop (``.run``), for
    `NemoGymEnv`; started first, so that NeMo Gym imports while ``miles train`` starts."""
    try:
        python = nemo_gym_python()
    except FileNotFoundError as e:
        pytest.skip(f"nemo-gym is not installed: run tools/setup_agent_frameworks.sh ({e})")
    loop = asyncio.new_event_loop()
    bridge = NemoGymBridge(python)
    try:
        loop.run_until_complete(bridge.start())
        yield SimpleNamespace(run=loop.run_until_complete, bridge=bridge)
    finally:
        loop.run_until_complete(bridge.aclose())
        loop.close()


def test_nemo_gym_agent_without_a_row_says_how_to_give_one() -> None:
    with pytest.raises(ValueError, match="needs a task row"):
        asyncio.run(NemoGymAgent("x.py:S")("http://x", SimpleNamespace(label="x"), {}))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_miles_train_runs_nemo_gym_agent_on_nemo_gym_rows(
    nemo_gym: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``miles train`` (the CLI's entry point, ``miles.cli.main``, in this process), one step,
    the row of a JSONL file played three times (`SCRIPTS`)."""
    from transformers import AutoTokenizer

    import miles.rollout.engines
    from miles.cli import main as miles_main
    from miles_env.integrations.nemo_gym import chat_messages, chat_tools
    from miles_rollout.session.render import TitoRenderer

    model = save_tiny_smol(tmp_path / "tiny-smol")
    tok = AutoTokenizer.from_pretrained(model)
    # About the prompt as the session renders it (the row's input and tools; NeMo Gym's tool
    # has a few more fields); the context has room after it for the three calls (108 tokens),
    # not for their three outputs (about 66 more).
    renderer = TitoRenderer(tok, None)
    messages = chat_messages([{"role": "user", "content": "What is 20 + 22? Use the add tool."}])
    tools = chat_tools([ADD])
    template = renderer.template_for(tools)
    text = renderer.render(messages, tools, template=template, add_generation_prompt=True)
    prompt_len = len(renderer.encode(text))
    context = prompt_len + 150
    monkeypatch.setattr(_Scripted, "scripts", {})
    monkeypatch.setattr(_Scripted, "tokenizer", tok)
    monkeypatch.setattr(miles.rollout.engines, "LocalEngineClient", _Scripted)
    played: list[dict[str, Any]] = []  # what the agent returned, as it returned it
    call = NemoGymAgent.__call__

    async def spy(self: NemoGymAgent, *args: Any) -> dict[str, Any]:
        played.append(await call(self, *args))
        return played[-1]

    monkeypatch.setattr(NemoGymAgent, "__call__", spy)
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROW) + "\n")
    recipe = tmp_path / "nemo_gym_e2e.py"
    recipe.write_text(
        textwrap.dedent(
            f"""
            def recipe():
                return {{
                    "name": "nemo-gym-e2e",
                    "model_path": {str(model)!r},
                    "engine": {{
                        "dtype": "float32", "max_running_requests": 4, "context_length": {context},
                    }},
                    "sampling": {{"temperature": 1.0, "max_new_tokens": 128}},
                    "trainer": {{"lr": 1e-4, "dtype": "float32", "micro_batch_size": 4}},
                    "rollout": {{
                        "prompts_per_step": 1,
                        "n_samples_per_prompt": 3,
                        "generate_fn": "multi_turn",
                        "agent": "miles_env.integrations.nemo_gym:nemo_gym_agent",
                    }},
                    "task": {{
                        "name": "nemo_gym",
                        "params": {{
                            "data": "rows.jsonl",
                            "resources_server": {f"{SERVER}:AddServer"!r},
                            "max_turns": 4,
                        }},
                        "reward_fn": "miles_env.rollout:episode_reward",
                    }},
                    "run": {{"num_steps": 1, "dump_samples": True}},
                }}
            """
        )
    )
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the recipe's folder is added to it
    assert miles_main(["train", str(recipe), "--out", str(run), "--no-progress"]) == 0
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1
    assert row["rollout/failed_frac"] == 0.0, row
    assert row["train/samples"] == 3.0
    assert row["train/loss"] == row["train/loss"]  # trained (finite)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == len(played) == 3

    # NeMo Gym's loop in the three episodes, as the agent returned them.
    def said(m: dict[str, Any]) -> str:
        last = (m["response"].get("output") or [{}])[-1]
        return "".join(c.get("text", "") for c in last.get("content") or [])

    (full,) = [m for m in played if m["stopped"] == "context_full"]
    (solved,) = [m for m in played if m is not full and said(m) == "The sum is 42."]
    (noisy,) = [m for m in played if m is not full and m is not solved]
    # Solved: the call, the resources server's answer, the final message; /verify paid for
    # the tool's sum stated in the answer.
    out = solved["response"]["output"]
    assert [o["type"] for o in out] == ["function_call", "function_call_output", "message"]
    assert json.loads(out[1]["output"]) == {"sum": 42}
    assert out[2]["content"][0]["text"] == "The sum is 42."
    assert (solved["reward"], solved["task"], solved["reward_reason"]) == (
        1.0, "add-20-22", "reward 1 from /verify",
    )  # fmt: skip
    assert solved["metrics"]["agentic/turns"] == 2.0
    assert solved["metrics"]["agentic/tool_calls"] == 1.0
    assert solved["stopped"] == "done"
    # The engine's own reply after the tool output, graded by /verify as it is.
    assert noisy["response"]["output"][1]["type"] == "function_call_output"
    assert noisy["reward"] == (1.0 if "42" in said(noisy) else 0.0), said(noisy)
    assert noisy["stopped"] in ("done", "length")
    # Three calls whose outputs the context cannot hold: NeMo Gym's loop fails at the refused
    # model call; reward 0 with the reason (not verified), the call's turn kept.
    assert full["reward"] == 0.0
    assert f"maximum context length is {context} tokens" in full["reward_reason"]
    assert full["reward_reason"].endswith(
        "over the engine's context length; start a new session or shorten it)"
    )
    assert row["rollout/agentic/context_full"] == 1.0  # a mean over the episodes it names
    assert row["rollout/agentic/reward/add-20-22"] == pytest.approx((1.0 + noisy["reward"]) / 3)
    # The trained samples: the session's tokens, the rewards /verify's (0 when not verified).
    assert sorted(s["reward"] for s in samples) == sorted(m["reward"] for m in played)
    trained: dict[tuple[float, int], str] = {}
    masked: dict[tuple[float, int], str] = {}
    for s in samples:
        tokens, mask = s["tokens"], s["loss_mask"]
        first = mask.index(1)
        prompt = tok.decode(tokens[:first])
        # What NeMo Gym's agent sent: the row's input and its tool, as the session rendered them.
        assert "What is 20 + 22? Use the add tool." in prompt
        assert '"name": "add"' in prompt
        assert abs(first - prompt_len) <= 8  # the estimate the context was sized by
        # Generated ids trained (mask 1, a weight version), the rest masked.
        assert all((v is None) == (m == 0) for v, m in zip(s["weight_versions"], mask, strict=True))
        key = s["reward"], sum(mask)
        trained[key] = str(tok.decode([t for t, m in zip(tokens, mask, strict=True) if m]))
        response = zip(tokens[first:], mask[first:], strict=True)
        masked[key] = str(tok.decode([t for t, m in response if not m]))
    end = "<|im_end|>"
    calls3 = SCRIPTS[2][0]
    solved_text = tok.decode(tok.encode(CALL + end + "The sum is 42." + end))
    (solved_key,) = [k for k, v in trained.items() if v == solved_text]
    assert solved_key[0] == 1.0
    # The tool output between the turns is masked out, the calls are not.
    assert '{"sum":42}' in masked[solved_key].replace(" ", "")
    assert "<tool_call>" not in masked[solved_key]
    (full_key,) = [k for k, v in trained.items() if v == tok.decode(tok.encode(calls3 + end))]
    assert full_key == (0.0, len(tok.encode(calls3)) + 1)
    assert masked[full_key] == ""  # one turn: nothing after it


def _call(cid: str, name: str, args: Any) -> dict[str, Any]:
    text = args if isinstance(args, str) else json.dumps(args)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": text}}


def test_nemo_gym_resources_server_as_an_environment(nemo_gym: Any) -> None:
    """Miles plays the agent (a scripted chat) on the resources server: bad calls come back
    as tool errors, ``/verify`` pays 1.0 for the tool's sum stated, 0.0 for a wrong answer."""

    def agent(answer_with_sum: bool) -> Any:
        async def chat(
            messages: list[dict[str, Any]], tools: list[dict[str, Any]]
        ) -> dict[str, Any]:
            assert [t["function"]["name"] for t in tools] == ["add"]
            if messages[-1]["role"] == "user":
                calls = [
                    _call("c0", "add", {"a": "two"}),
                    _call("c1", "sub", {}),
                    _call("c2", "add", {"a": 20, "b": 22}),
                ]
                return {"role": "assistant", "content": "", "tool_calls": calls}
            total = json.loads(messages[-1]["content"])["sum"]
            return {
                "role": "assistant",
                "content": f"The sum is {total if answer_with_sum else 0}.",
            }

        return chat

    run = nemo_gym.run
    url = run(nemo_gym.bridge.serve_resources(f"{SERVER}:AddServer"))  # the agent test's server
    r = run(run_episode(NemoGymEnv(url), ROW, agent(True)))
    assert (r.reward, r.stopped) == (1.0, "done"), r.info
    out = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert "missing argument b" in out[0]
    assert "unknown tool 'sub'" in out[1]
    assert json.loads(out[2]) == {"sum": 42}
    assert (r.metrics["tool_calls"], r.metrics["tool_errors"]) == (3, 2)
    assert r.info["task"] == "add-20-22"
    wrong = run(run_episode(NemoGymEnv(url), ROW, agent(False)))
    assert wrong.reward == 0.0  # /verify read the final message
    with pytest.raises(ValueError, match="responses_create_params"):
        run(run_episode(NemoGymEnv(url), {"input": "hi"}, agent(True)))
