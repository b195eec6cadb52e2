"""A scripted tool-calling policy: the agentic path end to end, deterministic, on any CPU.

A small model cannot solve terminal tasks, so a run with it tests little beyond "reward 0".
The scripted policy replaces only the model's sampling: each episode still runs through a real
TITO session server (chat template, tool-call parsing, exact ids, loss mask 0 on tool
outputs), the real episode agent and sandbox, the task's real verifier, and the trainer
trains on the resulting samples. What the "model" says is read from a script instead of being
sampled: the reply's text is written in the template family's tool-call format, tokenized, and
returned as the engine's output with logprob 0.0 per token (a deterministic policy gives its
tokens probability 1; the trainer recomputes the current policy's logprobs itself).

The script plays four roles by the sample's index in its group, so every group has reward
variance (GRPO has something to learn from):

- ``0``: the oracle: the task's ``solution/solve.sh`` as tool calls, then "done" (reward 1);
- ``1``: a bad call first (bash without its ``command``, an unknown tool), then the oracle
  (reward 1, two tool errors);
- ``2``: gives up at once (reward 0);
- ``3``: never stops: ``ls`` until ``max_turns`` (reward 0, ``max_turns_hit``).

    rollout: {generate_fn: "miles.agentic.scripted:scripted_policy"}
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_env.rollout import terminal_agent
from miles_rollout import FinishReason, GenerateContext, GenerateOutput, MultiTurnGenerate, Sample
from miles_rollout.session import start_sessions
from miles_rollout.session.families import detect_family

__all__ = ["ROLES", "ScriptedPolicy", "script_for", "scripted_policy"]

ROLES = ("oracle", "bad_call_then_oracle", "give_up", "never_stop")
_SCRIPT_PATH = "/tmp/.scripted/solve.sh"


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def script_for(sample: Sample) -> list[dict[str, Any]]:
    """The replies of ``sample``'s episode: each ``{"content": str, "calls": [{"name",
    "arguments"}]}``; the episode's turns past the script repeat its last reply."""
    role = ROLES[sample.index % len(ROLES)]
    done = {"content": "Done.", "calls": []}
    if role == "give_up":
        return [{"content": "I cannot do this task.", "calls": []}]
    if role == "never_stop":
        return [{"content": "", "calls": [_call("bash", command="ls")]}]
    solution = Path(str(sample.label)) / "solution" / "solve.sh"
    solve = solution.read_text() if solution.is_file() else "true\n"
    toolset = (sample.metadata.get("env") or {}).get("toolset", "bash")
    if toolset == "coding":
        oracle = [
            {"content": "", "calls": [_call("write_file", path=_SCRIPT_PATH, content=solve)]},
            {"content": "", "calls": [_call("bash", command=f"bash {_SCRIPT_PATH}")]},
        ]
    else:
        oracle = [{"content": "", "calls": [_call("bash", command=solve)]}]
    look = {"content": "", "calls": [_call("bash", command="ls -la")]}
    if role == "oracle":
        return [look, *oracle, done]
    bad = {"content": "", "calls": [_call("bash", cmd="ls"), _call("run", command="ls")]}
    return [bad, *oracle, done]


def _render(reply: Mapping[str, Any], parser: str) -> str:
    """A reply as the model would write it in the family's tool-call format."""
    content, calls = str(reply.get("content") or ""), list(reply.get("calls") or [])
    if not calls:
        return content
    if parser == "hermes":  # as the ChatML / Qwen templates render an assistant turn
        blocks = [
            "<tool_call>\n"
            + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
            + "\n</tool_call>"
            for c in calls
        ]
        return (content + "\n" if content else "") + "\n".join(blocks)
    if parser == "llama3_json":
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
            for c in calls
        )
    if parser == "mistral":
        return content + "[TOOL_CALLS]" + json.dumps(calls, ensure_ascii=False)
    raise ValueError(f"the scripted policy cannot write tool calls for parser {parser!r}")


class _ScriptedClient:
    """An engine client whose generations come from per-session scripts (keyed by the
    session id the session server sends as the routing key); everything else (server info,
    weight version) is the real engine's."""

    def __init__(self, inner: Any, tokenizer: Any) -> None:
        self._inner = inner
        self._tok = tokenizer
        family = detect_family(str(tokenizer.chat_template or ""))
        self._parser = family.tool_parser
        self._end_id = int(tokenizer.convert_tokens_to_ids(family.turn_end))
        self.scripts: dict[str, Iterator[Mapping[str, Any]]] = {}
        self._last: dict[str, Mapping[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Any = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        routing_key: str | None = None,
        **_: Any,
    ) -> GenerateOutput:
        key = str(routing_key)
        reply = next(self.scripts[key], None) or self._last[key]
        self._last[key] = reply
        ids = list(self._tok.encode(_render(reply, self._parser), add_special_tokens=False))
        ids.append(self._end_id)
        finish = FinishReason(type="stop", matched=self._end_id)
        limit = getattr(sampling_params, "max_new_tokens", None)
        if limit is not None and len(ids) > limit:  # as an engine would cut it
            ids, finish = ids[:limit], FinishReason(type="length", length=limit)
        version = await self._inner.get_weight_version()
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[0.0] * len(ids) if return_logprob else None,
            finish_reason=finish,
            weight_version=version,
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            rid=rid or key,
            output_weight_versions=[version] * len(ids),
        )


class ScriptedPolicy:
    """A ``GenerateFn``: the episode agent plays each sample against the script (module
    docstring) through its own TITO session server, in front of the run's engine.

    Args:
        agent: the episode agent (default ``miles_env.rollout:terminal_agent``).
    """

    needs_sessions = False  # it starts its own, in front of the scripted client

    def __init__(self, agent: Any = terminal_agent) -> None:
        self.agent = agent

    async def __call__(self, ctx: GenerateContext, sample: Sample) -> Sample:
        """Run ``sample``'s episode with the scripted replies; fill it from the session."""
        client = _ScriptedClient(ctx.client, ctx.tokenizer)
        server = await start_sessions(client, tokenizer=ctx.tokenizer)
        replies = script_for(sample)

        async def agent(base_url: str, s: Sample, request: dict[str, Any]) -> Any:
            sid = base_url.rstrip("/").split("/")[-2]  # .../sessions/{id}/v1
            client.scripts[sid] = iter(replies)
            return await self.agent(base_url, s, request)

        try:
            inner = GenerateContext(
                client=client,
                tokenizer=ctx.tokenizer,
                sampling_params=ctx.sampling_params,
                sessions_url=server.url,
            )
            return await MultiTurnGenerate(agent)(inner, sample)
        finally:
            await server.close()


scripted_policy = ScriptedPolicy()
"""The instance a recipe names: ``rollout.generate_fn: miles.agentic.scripted:scripted_policy``."""
