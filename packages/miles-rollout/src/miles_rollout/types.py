"""The types a user implements or receives: prompts, tasks, rewards, generate and agent functions.

Every signature here is pinned by ``tests/test_contracts.py``; a change is a breaking change.

- ``PromptItem``: one prompt (chat messages) and what the reward needs (``label``).
- ``Task``: ``sample(n) -> list[PromptItem]`` and ``reward(response, label) -> float``; a
  recipe names a ``TaskFactory`` (``factory(**params) -> Task``) by dotted path.
- ``RewardFn``: ``reward_fn(sample) -> float`` (or an awaitable of it); replaces a task's own
  reward when a recipe names one.
- ``GenerateFn``: ``async generate(ctx, sample) -> sample``: turns one prompt into one
  trajectory (tokens, loss mask, logprobs, weight versions, status). Built in: single-turn
  (one ``/generate`` call) and session-based multi-turn (an agent talking to a TITO session
  server). A user's own is named by dotted path.
- ``AgentFn``: ``async agent(base_url, sample, request) -> dict | None``: a multi-turn agent
  that talks OpenAI chat to ``base_url`` (one session); what it returns lands in
  ``sample.metadata``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_rollout.sample import Sample

if TYPE_CHECKING:
    from miles_rollout.client import EngineClient
    from miles_rollout.sampling_params import SamplingParams

__all__ = [
    "AgentFn",
    "GenerateContext",
    "GenerateFn",
    "PromptItem",
    "RewardFn",
    "Task",
    "TaskFactory",
]


@dataclass(kw_only=True, slots=True)
class PromptItem:
    """One prompt: chat messages plus whatever the reward needs to grade a response."""

    messages: list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """What the loop needs from a task."""

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` prompts."""
        ...

    def reward(self, response: str, label: Any) -> float:
        """Grade one response."""
        ...


TaskFactory = Callable[..., Task]
"""``factory(**params) -> Task``: what a recipe's ``task.name`` dotted path points at."""

RewardFn = Callable[[Sample], "float | Awaitable[float]"]
"""``reward_fn(sample) -> float`` (sync or async), called once per finished sample."""


@dataclass(kw_only=True, slots=True)
class GenerateContext:
    """What a generate function gets besides the sample (shared by a whole rollout).

    Attributes:
        client: the engine (embedded, or SGLang / a router over HTTP).
        tokenizer: the policy's HF tokenizer (chat template, decoding).
        sampling_params: the rollout's sampling parameters (per turn for multi-turn).
        sessions_url: base URL of a TITO session server in front of ``client`` (set by
            ``generate_rollout`` for generate functions with ``needs_sessions = True``).
        return_routed_experts: ask the engine for each token's MoE expert ids (R3 replay in
            the trainer); they land in ``sample.routed_experts``.
    """

    client: EngineClient
    tokenizer: Any
    sampling_params: SamplingParams
    sessions_url: str | None = None
    return_routed_experts: bool = False


@runtime_checkable
class GenerateFn(Protocol):
    """``async generate(ctx, sample) -> sample``: one prompt in, one trajectory out.

    The sample arrives with ``prompt``, ``label``, ``group_index``, ``index`` and
    ``metadata`` set; the function fills ``tokens``, ``response_length``, ``loss_mask``,
    ``rollout_logprobs``, ``weight_versions``, ``response`` and ``status`` (and may add
    ``metadata``) and returns it. The reward is computed afterwards by the rollout. A function
    that needs a TITO session server sets the attribute ``needs_sessions = True``.
    """

    def __call__(self, ctx: GenerateContext, sample: Sample) -> Awaitable[Sample]: ...


AgentFn = Callable[[str, Sample, dict[str, Any]], Awaitable["dict[str, Any] | None"]]
"""``async agent(base_url, sample, request) -> dict | None``.

``base_url`` is one session's OpenAI base URL (``.../sessions/{id}/v1``); ``request`` holds the
chat-completion fields to send with every call (``temperature``, ``top_p``, ``max_tokens``,
...). The returned dict is merged into ``sample.metadata``.
"""
