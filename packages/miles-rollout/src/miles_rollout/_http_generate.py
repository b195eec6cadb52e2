"""The ``/generate`` request and response shapes (SGLang's ``GenerateReqInput`` subset)."""

from __future__ import annotations

import base64
import sys
from dataclasses import dataclass
from typing import Any

import torch

from miles_rollout.outputs import GenerateOutput
from miles_rollout.sampling_params import SamplingParams

__all__ = [
    "GenerateItem",
    "ParsedGenerate",
    "decode_routed_experts",
    "encode_routed_experts",
    "parse_generate",
    "response_dict",
]

# GenerateReqInput fields this server implements.
_SUPPORTED = {
    "input_ids",
    "text",
    "sampling_params",
    "return_logprob",
    "rid",
    "stream",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "data_parallel_rank",
    "routed_dp_rank",
    "routing_key",
    "return_routed_experts",
}
# Bookkeeping fields that do not change the result: accepted with any value and ignored
# (sglang-router 0.3.2 sends ``log_metrics: true`` on every request).
_IGNORED = {
    "log_metrics",
    "priority",
    "custom_labels",
    "conversation_id",
    "session_id",
    "received_time",
    "external_trace_header",
    "no_logs",
    "extra_key",
    "cache_salt",
}
# Any other field is accepted only with a neutral value (routers re-serialise requests and may
# add fields with their defaults); otherwise the request is rejected, not silently changed.
_NEUTRAL: tuple[Any, ...] = (None, False, 0, -1, "", [], {})


@dataclass(slots=True)
class GenerateItem:
    """One prompt of a (possibly batched) ``/generate`` request."""

    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool
    rid: str | None
    text_in_logprobs: bool
    data_parallel_rank: int | None = None
    routing_key: str | None = None
    return_routed_experts: bool = False


@dataclass(slots=True)
class ParsedGenerate:
    items: list[GenerateItem]
    is_batch: bool


def parse_generate(body: dict[str, Any], tokenizer: Any) -> ParsedGenerate:
    """Validate a ``/generate`` body; raise ``ValueError`` with a clear message otherwise."""
    extra = {k: v for k, v in body.items() if k not in _SUPPORTED and k not in _IGNORED}
    bad = sorted(k for k, v in extra.items() if not any(_same(v, n) for n in _NEUTRAL))
    if bad:
        raise ValueError(
            f"/generate fields not supported by the miles-rollout server: {bad}; supported: "
            f"{sorted(_SUPPORTED)}"
        )
    if body.get("stream"):
        raise ValueError("stream=true is not supported by the miles-rollout server; omit it")
    if body.get("logprob_start_len") not in (None, -1):
        raise ValueError(
            "logprob_start_len (input-token logprobs) is not supported; only output-token "
            "logprobs are returned"
        )
    if body.get("top_logprobs_num") not in (None, 0):
        raise ValueError("top_logprobs_num is not supported; only sampled-token logprobs")
    dp_rank = _dp_rank(body)
    routing_key = body.get("routing_key")
    if routing_key is not None and not isinstance(routing_key, str):
        raise ValueError(f"routing_key must be a string, got {routing_key!r}")

    prompts, is_batch = _prompts(body, tokenizer)
    n = len(prompts)
    params = _per_item(body.get("sampling_params"), n, "sampling_params")
    logprob = _per_item(body.get("return_logprob"), n, "return_logprob")
    rids = _per_item(body.get("rid"), n, "rid")
    routed = _per_item(body.get("return_routed_experts"), n, "return_routed_experts")
    if is_batch and isinstance(body.get("rid"), str):
        rids = [f"{body['rid']}_{i}" for i in range(n)]
    text_lp = bool(body.get("return_text_in_logprobs", False))
    items = []
    for i in range(n):
        rid = rids[i]
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"rid must be a string, got {rid!r}")
        items.append(
            GenerateItem(
                input_ids=prompts[i],
                sampling_params=SamplingParams.from_dict(params[i]),
                return_logprob=bool(logprob[i]),
                rid=rid,
                text_in_logprobs=text_lp,
                data_parallel_rank=dp_rank,
                routing_key=routing_key,
                return_routed_experts=bool(routed[i]),
            )
        )
    return ParsedGenerate(items=items, is_batch=is_batch)


def _dp_rank(body: dict[str, Any]) -> int | None:
    """``data_parallel_rank`` (sglang-router's ``--dp-aware`` field) or its alias
    ``routed_dp_rank``; the engine checks that the rank exists."""
    ranks = [body[k] for k in ("data_parallel_rank", "routed_dp_rank") if body.get(k) is not None]
    if len(ranks) == 2 and ranks[0] != ranks[1]:
        raise ValueError(f"data_parallel_rank and routed_dp_rank disagree: {ranks}")
    if not ranks:
        return None
    rank = ranks[0]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"data_parallel_rank must be a non-negative integer, got {rank!r}")
    return rank


def response_dict(
    out: GenerateOutput, item: GenerateItem, tokenizer: Any, latency: float
) -> dict[str, Any]:
    """SGLang's non-streaming ``/generate`` response for one prompt."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason.to_json(),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "weight_version": out.weight_version,
        "e2e_latency": latency,
    }
    if out.output_weight_versions is not None:
        # A Miles extension: the weight version of each output token (SGLang reports one).
        meta["output_token_weight_versions"] = out.output_weight_versions
    if item.return_logprob:
        assert out.output_logprobs is not None
        texts: list[str | None]
        if item.text_in_logprobs and tokenizer is not None:
            texts = [tokenizer.decode([t]) for t in out.output_ids]
        else:
            texts = [None] * len(out.output_ids)
        meta["output_token_logprobs"] = [
            [lp, tok, txt] for lp, tok, txt in zip(out.output_logprobs, out.output_ids, texts)
        ]
    if item.return_routed_experts and out.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(out.routed_experts)
        # A Miles extension: SGLang's payload is flat; readers need the model's layers and
        # top-k to reshape it.
        meta["routed_experts_shape"] = list(out.routed_experts.shape)
    resp: dict[str, Any] = {"output_ids": out.output_ids, "meta_info": meta}
    if out.text is not None:
        resp["text"] = out.text
    return resp


def encode_routed_experts(experts: torch.Tensor) -> str:
    """SGLang's ``meta_info["routed_experts"]``: base64 of the int32 array's little-endian,
    C-order bytes (``[tokens, layers, top_k]`` flattened)."""
    raw = _little_endian(experts.to(torch.int32).contiguous())
    return base64.b64encode(raw.numpy().tobytes()).decode("ascii")


def decode_routed_experts(payload: str, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`encode_routed_experts` (``shape`` may hold one ``-1``)."""
    raw = bytearray(base64.b64decode(payload))
    flat = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.empty(0, dtype=torch.int32)
    return _little_endian(flat).reshape(*shape)


def _little_endian(t: torch.Tensor) -> torch.Tensor:
    """Swap int32 bytes on a big-endian host (SGLang's payload is little-endian)."""
    if sys.byteorder == "little":
        return t
    return t.contiguous().view(torch.uint8).view(-1, 4).flip(1).contiguous().view(torch.int32)


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral


def _prompts(body: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise ValueError("give exactly one of input_ids and text")
    if text is not None:
        if tokenizer is None:
            raise ValueError("text input needs a tokenizer and this model has none; send input_ids")
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError("text must be a string or a list of strings")
        return [list(tokenizer.encode(t)) for t in texts], not isinstance(text, str)
    if not isinstance(ids, list):
        raise ValueError(f"input_ids must be a list, got {type(ids).__name__}")
    if ids and all(isinstance(row, list) for row in ids):
        return ids, True
    return [ids], False


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n
