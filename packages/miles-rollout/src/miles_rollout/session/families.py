"""Per-family join fixes for TITO, as data: one small table entry per chat-template family.

A template closes each turn with an end-of-turn marker (``turn_end``) and may put text after it
(``turn_sep``) that the model never generates: ChatML templates (Qwen3, SmolLM2) write
``<|im_end|>\\n`` but the model stops at ``<|im_end|>``. When TITO appends the next messages
after the generated ids, it inserts ``turn_sep`` (and ``turn_end`` first, when the turn did not
end with it: a length cut or a stop string), so the ids equal what the template would render.

Each entry is checked against the tokenizer's template when a renderer is built
(:func:`check_family`): a rendered assistant turn must end with ``turn_end + turn_sep``.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_rollout.session.templates import CHATML_TOOLS_TEMPLATE, QWEN3_TEMPLATE

__all__ = ["FAMILIES", "TemplateFamily", "detect_family"]


@dataclass(frozen=True, slots=True)
class TemplateFamily:
    """How one chat-template family joins turns and writes tool calls.

    Attributes:
        name: the family's name (``--template-family`` on the command line).
        turn_end: the text of the token that ends a turn (the model's EOS for chat).
        turn_sep: what the template writes after ``turn_end`` and the model never generates.
        tool_parser: the name of the tool-call parser (see ``tool_parsers.PARSERS``).
        markers: substrings of a chat template that identify the family (all must occur).
        tools_template: the template used for sessions with tools when the tokenizer's own
            template ignores ``tools``; ``None`` to use the tokenizer's template as it is.
        decode_special: keep special tokens in the decoded text (Mistral's ``[TOOL_CALLS]``
            is a control token the parser needs); otherwise they are skipped.
        reasoning_tags: the (start, end) markers of a reasoning block at the start of a
            reply (Qwen3's ``<think>``); the block is returned as ``reasoning_content``, not
            content, so a client that drops it from the history still matches.
    """

    name: str
    turn_end: str
    turn_sep: str
    tool_parser: str
    markers: tuple[str, ...]
    tools_template: str | None = None
    decode_special: bool = False
    reasoning_tags: tuple[str, str] | None = None


FAMILIES: dict[str, TemplateFamily] = {
    f.name: f
    for f in (
        TemplateFamily(
            name="qwen3",
            turn_end="<|im_end|>",
            turn_sep="\n",
            tool_parser="hermes",
            markers=("<|im_start|>", "<tool_call>"),
            tools_template=QWEN3_TEMPLATE,
            reasoning_tags=("<think>", "</think>"),
        ),
        TemplateFamily(
            name="chatml",
            turn_end="<|im_end|>",
            turn_sep="\n",
            tool_parser="hermes",
            markers=("<|im_start|>",),
            tools_template=CHATML_TOOLS_TEMPLATE,
        ),
        TemplateFamily(
            name="llama3",
            turn_end="<|eot_id|>",
            turn_sep="",
            tool_parser="llama3_json",
            markers=("<|start_header_id|>",),
        ),
        TemplateFamily(
            name="mistral",
            turn_end="</s>",
            turn_sep="",
            tool_parser="mistral",
            markers=("[INST]",),
            decode_special=True,
        ),
    )
}


def detect_family(chat_template: str) -> TemplateFamily:
    """The first family (in table order) whose markers all occur in ``chat_template``.

    Raises:
        ValueError: no family matches (name one with ``--template-family``).
    """
    for family in FAMILIES.values():
        if all(m in chat_template for m in family.markers):
            return family
    raise ValueError(
        "cannot tell the chat template's family from its text; pass one of "
        f"{sorted(FAMILIES)} (--template-family / template_family=...)"
    )
