"""Session-based multi-turn generation: a user's agent talks OpenAI chat to a TITO session.

For each sample: ``POST /sessions`` on the rollout's session server, run the agent with that
session's OpenAI base URL, read the session's samples, delete the session. The trajectory is
the session's last sample (its exact ids, loss mask 1 on generated tokens only, logprobs and
weight versions); ``metadata["session_samples"]`` counts the samples the session made (more
than one when the agent rewrote its history, see the session server's policy).

    gen = MultiTurnGenerate("miles_rollout.tasks.guess_number:play")
    await generate_rollout(client, tok, items, ..., generate_fn=gen)
"""

from __future__ import annotations

from typing import Any

import aiohttp

from miles_rollout.generate.loading import is_async_callable, load_callable
from miles_rollout.generate.single_turn import finish_status
from miles_rollout.sample import Sample, SampleStatus
from miles_rollout.session.trajectory import decode_routed_experts
from miles_rollout.types import AgentFn, GenerateContext

__all__ = ["MultiTurnGenerate", "chat_request_fields"]


def chat_request_fields(ctx: GenerateContext) -> dict[str, Any]:
    """The chat-completion fields that carry the rollout's sampling parameters."""
    p = ctx.sampling_params
    fields: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p}
    if p.top_k != -1:
        fields["top_k"] = p.top_k
    if p.min_p:
        fields["min_p"] = p.min_p
    if p.max_new_tokens is not None:
        fields["max_tokens"] = p.max_new_tokens
    if p.stop:
        fields["stop"] = list(p.stop)
    return fields


class MultiTurnGenerate:
    """A :class:`~miles_rollout.types.GenerateFn` that runs an agent against a TITO session.

    Args:
        agent: an :data:`~miles_rollout.types.AgentFn` or its dotted path.
        timeout_s: the most seconds one session request (create, export, delete) may take;
            the agent's own chat calls use its own client and timeouts.

    Raises:
        ValueError: ``agent`` is not an async function (or a dotted path to one).
    """

    needs_sessions = True

    def __init__(self, agent: AgentFn | str, *, timeout_s: float = 60.0) -> None:
        fn = load_callable(agent) if isinstance(agent, str) else agent
        if not is_async_callable(fn):
            raise ValueError(
                f"agent {agent!r} must be an async function "
                "agent(base_url, sample, request) -> dict | None"
            )
        self.agent: AgentFn = fn
        self.timeout_s = timeout_s

    async def __call__(self, ctx: GenerateContext, sample: Sample) -> Sample:
        """Run the agent in a fresh session and fill ``sample`` from the session's export."""
        if ctx.sessions_url is None:
            raise ValueError(
                "multi-turn generation needs a TITO session server: run it through "
                "generate_rollout (which starts one) or set GenerateContext.sessions_url"
            )
        base = ctx.sessions_url.rstrip("/")
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.post(f"{base}/sessions", json={}) as resp:
                resp.raise_for_status()
                sid = (await resp.json())["session_id"]
            try:
                try:
                    info = await self.agent(
                        f"{base}/sessions/{sid}/v1", sample, chat_request_fields(ctx)
                    )
                except Exception as exc:  # the agent's failure fails this sample only
                    sample.status = SampleStatus.FAILED
                    sample.metadata["error"] = f"agent failed: {type(exc).__name__}: {exc}"
                    return sample
                async with http.get(f"{base}/sessions/{sid}/samples") as resp:
                    resp.raise_for_status()
                    exported = (await resp.json())["samples"]
            finally:
                async with http.delete(f"{base}/sessions/{sid}"):
                    pass
        if info:
            sample.metadata.update(info)
        if not exported:
            sample.status = SampleStatus.FAILED
            sample.metadata["error"] = "the agent made no successful chat call"
            return sample
        _fill(sample, exported[-1], ctx.tokenizer)
        sample.metadata["session_samples"] = len(exported)
        return sample


def _fill(sample: Sample, exported: dict[str, Any], tokenizer: Any) -> None:
    n = int(exported["response_length"])
    sample.tokens = list(exported["tokens"])
    sample.response_length = n
    sample.loss_mask = list(exported["loss_mask"])
    sample.rollout_logprobs = [float(x) for x in exported["rollout_logprobs"]]
    sample.weight_versions = list(exported["weight_versions"])
    sample.routed_experts = decode_routed_experts(exported.get("routed_experts"))
    sample.response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    sample.metadata["messages"] = exported["messages"]
    sample.metadata["num_turns"] = exported["num_turns"]
    sample.metadata["finish_reason"] = exported["finish_reason"]
    sample.status = finish_status(exported["finish_reason"])
