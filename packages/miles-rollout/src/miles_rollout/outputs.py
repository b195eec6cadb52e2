"""What a generate call returns (the same shape from the engine and from an SGLang server)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["FinishReason", "GenerateOutput"]

FinishType = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a request ended, shaped like SGLang's ``meta_info["finish_reason"]``.

    Attributes:
        type: ``"stop"`` (a stop token or string), ``"length"`` (``max_new_tokens`` or the
            context length) or ``"abort"`` (aborted, e.g. by ``pause_generation("abort")``).
        matched: for ``"stop"``: the token id or the stop string that matched.
        length: for ``"length"``: the number of generated tokens.
        message: for ``"abort"``: why.
    """

    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        """SGLang's JSON shape (``FINISH_MATCHED_TOKEN`` / ``FINISH_LENGTH`` / ``FINISH_ABORT``)."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> FinishReason:
        """Parse SGLang's JSON shape (``None``, which SGLang sends mid-stream, is an abort)."""
        if d is None:
            return cls(type="abort", message="no finish reason reported")
        kind = d.get("type")
        if kind == "stop":
            return cls(type="stop", matched=d.get("matched"))
        if kind == "length":
            return cls(type="length", length=d.get("length"))
        if kind == "abort":
            return cls(type="abort", message=d.get("message"))
        raise ValueError(f"unknown finish_reason type {kind!r} in {dict(d)!r}")


@dataclass(slots=True)
class GenerateOutput:
    """The result of one generate request.

    Attributes:
        output_ids: the generated token ids (a matched stop token is included).
        output_logprobs: one float per output token, ``log_softmax(logits_fp32 /
            temperature)[token]`` (temperature 1 when greedy), before any top-k / top-p /
            min-p truncation; ``None`` unless ``return_logprob`` was set.
        finish_reason: why the request ended.
        weight_version: the engine's weight version when the request finished.
        prompt_tokens: the number of prompt tokens.
        completion_tokens: ``len(output_ids)``.
        rid: the request id.
        text: the decoded output when the engine has a tokenizer, else ``None``.
        output_weight_versions: the weight version that produced each output token (one
            string per token). A request in flight across a weight update has tokens from
            two versions. Servers that do not report it per token (a stock SGLang server)
            give ``[weight_version] * completion_tokens`` through the client.
        cached_tokens: prompt tokens whose KV came from the prefix cache (SGLang's
            ``meta_info["cached_tokens"]``; counted once, at the request's first admission).
        routed_experts: for MoE models asked with ``return_routed_experts``: the experts each
            token was routed to, an int32 tensor ``[prompt_tokens + completion_tokens - 1,
            num_layers, top_k]`` (SGLang's shape: every token that went through a forward
            pass, i.e. all but the last output token); else ``None``.
    """

    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishReason
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    rid: str
    text: str | None = None
    output_weight_versions: list[str] | None = None
    cached_tokens: int = 0
    routed_experts: torch.Tensor | None = None
