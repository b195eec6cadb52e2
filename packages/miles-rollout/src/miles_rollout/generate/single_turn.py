"""Single-turn generation: one ``/generate`` call per sample, loss mask all ones."""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_rollout.sample import Sample, SampleStatus
from miles_rollout.sampling_params import SamplingParams
from miles_rollout.types import GenerateContext

__all__ = ["encode_prompt", "finish_status", "sample_params", "single_turn_generate"]

_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


def finish_status(finish_type: str | None) -> SampleStatus:
    """The sample status of an engine finish type (stop, length, abort)."""
    return _STATUS.get(finish_type or "", SampleStatus.FAILED)


def encode_prompt(tokenizer: Any, prompt: list[dict[str, Any]] | str) -> list[int]:
    """Token ids of a prompt: chat messages through the chat template, raw text as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False).input_ids)
    return list(
        tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def sample_params(ctx: GenerateContext, sample: Sample) -> SamplingParams:
    """The sampling parameters of one sample: the rollout's, with a per-sample seed when the
    sample's metadata holds ``sampling_seed`` (seed + the sample's index in its group)."""
    base = sample.metadata.get("sampling_seed")
    if base is None:
        return ctx.sampling_params
    seed = (int(base) + sample.index) & 0x7FFFFFFFFFFFFFFF
    return dataclasses.replace(ctx.sampling_params, seed=seed)


def _extra(ctx: GenerateContext) -> dict[str, Any]:
    return {"return_routed_experts": True} if ctx.return_routed_experts else {}


async def single_turn_generate(ctx: GenerateContext, sample: Sample) -> Sample:
    """Render the prompt, generate once, fill the sample (a :class:`GenerateFn`).

    Raises:
        RuntimeError: the engine returned a logprob count that differs from its token count.
    """
    prompt_ids = encode_prompt(ctx.tokenizer, sample.prompt)
    out = await ctx.client.generate(
        prompt_ids, sample_params(ctx, sample), return_logprob=True, **_extra(ctx)
    )
    ids = list(out.output_ids)
    logprobs = list(out.output_logprobs or [])
    if len(logprobs) != len(ids):
        raise RuntimeError(
            f"engine returned {len(ids)} tokens but {len(logprobs)} logprobs; the rollout needs "
            "one logprob per generated token (return_logprob=True)"
        )
    versions = getattr(out, "output_weight_versions", None)
    if versions is None or len(versions) != len(ids):
        versions = [out.weight_version] * len(ids)
    sample.tokens = prompt_ids + ids
    sample.response_length = len(ids)
    sample.loss_mask = [1] * len(ids)
    sample.rollout_logprobs = logprobs
    sample.weight_versions = list(versions)
    sample.routed_experts = getattr(out, "routed_experts", None)
    sample.response = ctx.tokenizer.decode(ids, skip_special_tokens=True)
    sample.metadata["finish_reason"] = out.finish_reason.type
    sample.status = finish_status(out.finish_reason.type)
    return sample
