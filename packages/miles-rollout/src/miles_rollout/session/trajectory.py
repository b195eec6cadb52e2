"""The token state of a session: one trajectory per sample, grown turn by turn.

A turn is planned (what to send the engine: kept ids + new prompt ids) without changing
anything, and committed only once the engine answered, so a failed turn leaves the session as
it was. The history policy (documented in the README):

- the stored messages are a prefix of the request (compared by :func:`message_key`): append
  the new messages' ids after the stored ids (TITO);
- the request is exactly the previous turn's request (a client retrying the last turn): roll
  that assistant turn back and generate it again (one turn at most);
- anything else (an edited or dropped message, dropped reasoning, other tools): start a new
  sample in the same session, rendered from scratch; the old one stays exportable.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_rollout.session.protocol import Message, message_key
from miles_rollout.session.render import TitoRenderer

__all__ = ["Trajectory", "TurnPlan", "decode_routed_experts"]


@dataclass(kw_only=True, slots=True)
class TurnPlan:
    """What one turn sends the engine, decided before the engine is called.

    Attributes:
        kind: ``first`` (an empty trajectory), ``append`` (TITO), ``retry`` (roll the last
            assistant turn back) or ``new_sample`` (history not append-only).
        keep: how many stored ids stay (the rest are rolled back).
        prompt_ids: ids appended after the kept ones before generating.
        messages: the request's messages.
        tools: the request's tools.
        template: the session template (``None``: the tokenizer's own).
        reason: for ``new_sample``, why the history was not append-only.
    """

    kind: Literal["first", "append", "retry", "new_sample"]
    keep: int
    prompt_ids: list[int]
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    template: str | None
    reason: str | None = None


@dataclass(slots=True)
class _Turn:
    request_len: int  # messages in the request that produced this turn
    prompt_end: int  # ids stored when generation started
    finish_reason: str


def _tools_key(tools: Sequence[Any] | None) -> str:
    return json.dumps(list(tools or []), sort_keys=True)


@dataclass(slots=True)
class Trajectory:
    """One sample: every id of a multi-turn conversation, with per-token training fields.

    ``loss_mask``, ``logprobs`` and ``weight_versions`` cover every id (prompt included); the
    export cuts them to the response (from the first generated id on).
    """

    renderer: TitoRenderer
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str | None] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template: str | None = None
    routed_experts: Any = None  # int32 [len(tokens) - 1, layers, top_k] of the latest turn
    turns: list[_Turn] = field(default_factory=list)
    _keys: list[tuple[Any, ...]] = field(default_factory=list)

    @property
    def closed(self) -> bool:
        """Whether the last generated turn ended with the family's end-of-turn token."""
        return bool(self.tokens) and self.tokens[-1] == self.renderer.turn_end_id

    def plan(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> TurnPlan:
        """Decide how the next turn is tokenized (see the module docstring).

        Raises:
            ValueError: the messages cannot be rendered (bad content for the template).
        """
        r = self.renderer
        if not self.turns:
            template = r.template_for(tools)
            ids = r.first_turn(messages, tools, template)
            return TurnPlan(
                kind="first",
                keep=0,
                prompt_ids=ids,
                messages=messages,
                tools=tools,
                template=template,
            )
        keys = [message_key(m) for m in messages]
        n = len(self._keys)
        reason = None
        if _tools_key(tools) != _tools_key(self.tools):
            reason = "the tools differ from the sample's"
        elif keys[:n] == self._keys:
            ids = r.continuation(messages[n:], tools, self.template, closed=self.closed)
            return TurnPlan(
                kind="append",
                keep=len(self.tokens),
                prompt_ids=ids,
                messages=messages,
                tools=tools,
                template=self.template,
            )
        elif keys == self._keys[: self.turns[-1].request_len]:
            return TurnPlan(
                kind="retry",
                keep=self.turns[-1].prompt_end,
                prompt_ids=[],
                messages=messages,
                tools=tools,
                template=self.template,
            )
        else:
            diff = next((i for i, (a, b) in enumerate(zip(keys, self._keys)) if a != b), None)
            reason = (
                f"message {diff} differs from the stored one"
                if diff is not None
                else f"the request has {len(keys)} messages, fewer than the {n} stored"
            )
        template = r.template_for(tools)
        return TurnPlan(
            kind="new_sample",
            keep=0,
            prompt_ids=r.first_turn(messages, tools, template),
            messages=messages,
            tools=tools,
            template=template,
            reason=reason,
        )

    def input_ids(self, plan: TurnPlan) -> list[int]:
        """The engine's input for ``plan``."""
        return self.tokens[: plan.keep] + plan.prompt_ids

    def commit(
        self,
        plan: TurnPlan,
        *,
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        weight_versions: Sequence[str | None],
        reply: Message,
        finish_reason: str,
        routed_experts: Any = None,
    ) -> None:
        """Store a generated turn: ids verbatim, loss mask 1 on them only.

        Args:
            plan: the plan the engine ran (``new_sample`` plans go to a fresh trajectory).
            output_ids: the generated ids.
            logprobs: one per generated id.
            weight_versions: one per generated id.
            reply: the assistant message returned to the client.
            finish_reason: the engine's finish type.
            routed_experts: the engine's routed experts for the whole request, if any.
        """
        n = len(output_ids)
        assert len(logprobs) == n, (len(logprobs), n)
        assert len(weight_versions) == n, (len(weight_versions), n)
        if plan.kind == "retry":
            self.turns.pop()
        keep = plan.keep
        del self.tokens[keep:], self.loss_mask[keep:], self.logprobs[keep:]
        del self.weight_versions[keep:]
        prompt_end = keep + len(plan.prompt_ids)
        self.tokens += plan.prompt_ids
        self.loss_mask += [0] * len(plan.prompt_ids)
        self.logprobs += [0.0] * len(plan.prompt_ids)
        self.weight_versions += [None] * len(plan.prompt_ids)
        self.tokens += output_ids
        self.loss_mask += [1] * n
        self.logprobs += logprobs
        self.weight_versions += weight_versions
        self.tools, self.template = plan.tools, plan.template
        self.messages = [*plan.messages, reply]
        self._keys = [message_key(m) for m in self.messages]
        self.turns.append(_Turn(len(plan.messages), prompt_end, finish_reason))
        rows = getattr(routed_experts, "shape", (None,))[0]
        self.routed_experts = routed_experts if rows == len(self.tokens) - 1 else None

    @property
    def prompt_length(self) -> int:
        """Ids before the first generated one."""
        return self.turns[0].prompt_end if self.turns else len(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        """The exported sample (response fields cut as in ``miles_rollout.Sample``)."""
        p = self.prompt_length
        experts = self.routed_experts
        return {
            "tokens": list(self.tokens),
            "prompt_length": p,
            "response_length": len(self.tokens) - p,
            "loss_mask": self.loss_mask[p:],
            "rollout_logprobs": self.logprobs[p:],
            "weight_versions": self.weight_versions[p:],
            "routed_experts": None if experts is None else _encode_experts(experts),
            "messages": self.messages,
            "tools": self.tools,
            "num_turns": len(self.turns),
            "finish_reason": self.turns[-1].finish_reason if self.turns else None,
        }


def _encode_experts(experts: Any) -> dict[str, Any]:
    import numpy as np

    if hasattr(experts, "numpy"):  # a torch tensor (GenerateOutput.routed_experts)
        experts = experts.detach().cpu().numpy()
    arr = np.ascontiguousarray(experts, dtype=np.int32)
    return {
        "dtype": "int32",
        "shape": list(arr.shape),
        "data": base64.b64encode(arr.tobytes()).decode(),
    }


def decode_routed_experts(value: dict[str, Any] | None) -> Any:
    """An exported ``routed_experts`` field as an int32 numpy array (or ``None``)."""
    if value is None:
        return None
    import numpy as np

    raw = base64.b64decode(value["data"])
    return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"])
