"""The unit that travels from rollout to training: one trajectory of one prompt."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sample", "SampleStatus"]


class SampleStatus(str, enum.Enum):
    """Where a sample stands. Only ``COMPLETED`` and ``TRUNCATED`` samples are trainable."""

    PENDING = "pending"
    COMPLETED = "completed"  # the model stopped on its own (EOS or a stop token)
    TRUNCATED = "truncated"  # hit max_new_tokens or the context length
    ABORTED = "aborted"  # the engine aborted it (pause with mode=abort, shutdown)
    FAILED = "failed"  # the engine or the reward raised; see metadata["error"]


@dataclass(kw_only=True, slots=True)
class Sample:
    """One trajectory.

    Token conventions (docs/architecture.md): ``tokens = prompt_ids + response_ids``;
    ``loss_mask`` and ``rollout_logprobs`` cover the response only; ``loss_mask`` is 1 on tokens
    the model generated and 0 on tokens it did not (tool output, observations).

    Attributes:
        group_index: index of the prompt group within the rollout batch.
        index: index of the sample within its group.
        prompt: the chat messages (or raw text) the trajectory started from.
        label: whatever the reward needs (the reference answer).
        tokens: prompt and response token ids.
        response_length: number of response tokens at the end of ``tokens``.
        loss_mask: per response token, 1 to train on it, 0 to skip it.
        rollout_logprobs: per response token, the engine's logprob (0.0 where not generated).
        response: decoded response text.
        reward: scalar reward, ``None`` until graded.
        status: see ``SampleStatus``.
        weight_versions: per response token, the engine weight version that generated it;
            ``None`` on tokens the model did not generate (tool output). A multi-turn sample
            or a request in flight across a weight update holds several versions.
        routed_experts: for MoE engines that report it (R3): an int32 array
            ``[len(tokens) - 1, num_layers, top_k]`` of the experts each token was routed
            to; else ``None``.
        metadata: free-form extras (finish reason, errors, timings).
    """

    group_index: int
    index: int
    prompt: list[dict[str, Any]] | str
    label: Any = None
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    response: str = ""
    reward: float | None = None
    status: SampleStatus = SampleStatus.PENDING
    weight_versions: list[str | None] = field(default_factory=list)
    routed_experts: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def weight_version(self) -> str | None:
        """The newest weight version among the generated tokens (``None`` before any)."""
        versions = [v for v in self.weight_versions if v is not None]
        return max(versions, key=_version_key) if versions else None

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens."""
        return len(self.tokens) - self.response_length

    @property
    def response_ids(self) -> list[int]:
        """The response token ids."""
        return self.tokens[len(self.tokens) - self.response_length :]

    def check(self) -> None:
        """Raise ValueError when the token-level fields disagree in length."""
        n = self.response_length
        if not 0 <= n <= len(self.tokens):
            raise ValueError(
                f"sample {self.group_index}/{self.index}: response_length {n} outside "
                f"0..{len(self.tokens)}"
            )
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"sample {self.group_index}/{self.index}: loss_mask ({len(self.loss_mask)}) and "
                f"rollout_logprobs ({len(self.rollout_logprobs)}) must both have "
                f"response_length ({n}) entries"
            )
        if self.weight_versions and len(self.weight_versions) != n:
            raise ValueError(
                f"sample {self.group_index}/{self.index}: weight_versions "
                f"({len(self.weight_versions)}) must have response_length ({n}) entries"
            )


def _version_key(version: str) -> tuple[int, int | str]:
    # Versions are strings ("0", "1", ... from the loop); compare numerically when they are.
    return (1, int(version)) if version.isdigit() else (0, version)
