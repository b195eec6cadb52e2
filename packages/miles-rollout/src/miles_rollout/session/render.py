"""Render and tokenize chat turns for TITO: the whole prompt once, then only what is appended.

Turn 1 renders the chat template over the request's messages (with tools) plus the generation
prompt and tokenizes it. A later turn renders only the appended messages: it renders a fixed
three-message stand-in history (system, user, assistant) with and without the appended
messages and keeps the difference, so its cost does not grow with the real history. The
family's join text (``turn_sep``, and ``turn_end`` when the generated turn did not end with
it) goes in front, and the result is tokenized on its own. Every piece starts after a special
token the model generated (or the join text), so no BPE merge crosses the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_rollout.session.families import FAMILIES, TemplateFamily, detect_family

__all__ = ["TitoRenderer"]

Message = dict[str, Any]

# Stand-in history for rendering appended messages; its content never reaches the ids.
_BASE: list[Message] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


class TitoRenderer:
    """Chat-template rendering and tokenization of one tokenizer, with its family's join fix.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        family: a family name from ``FAMILIES``, a :class:`TemplateFamily`, or ``None`` to
            detect it from the template text.
        template_kwargs: extra variables for the template (e.g. ``{"enable_thinking": False}``).

    Raises:
        ValueError: no chat template; the family's end-of-turn text is not one token of the
            vocabulary; or the template does not close an assistant turn with the family's
            ``turn_end + turn_sep`` (the wrong family).
    """

    def __init__(
        self,
        tokenizer: Any,
        family: str | TemplateFamily | None = None,
        *,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: use the default one
            template = template.get("default")
        if not isinstance(template, str) or not template:
            raise ValueError(
                "the tokenizer has no chat template; TITO renders messages with it (add "
                "chat_template.jinja to the model directory)"
            )
        if isinstance(family, str):
            if family not in FAMILIES:
                raise ValueError(f"unknown template family {family!r}; known: {sorted(FAMILIES)}")
            family = FAMILIES[family]
        self.tokenizer = tokenizer
        self.family = family if family is not None else detect_family(template)
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        self.supports_tools = "tools" in template
        ids = tokenizer.encode(self.family.turn_end, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"family {self.family.name!r}: its end of turn {self.family.turn_end!r} is "
                f"{len(ids)} tokens in this vocabulary, not one; pick another family"
            )
        self.turn_end_id: int = ids[0]
        self.check(None)
        if self.family.tools_template is not None and not self.supports_tools:
            self.check(self.family.tools_template)

    def template_for(self, tools: Sequence[Any] | None) -> str | None:
        """The template of a session with these tools (``None``: the tokenizer's own).

        Raises:
            ValueError: tools are given but no template of this family can render them.
        """
        if not tools or self.supports_tools:
            return None
        if self.family.tools_template is None:
            raise ValueError(
                f"the chat template ignores tools and family {self.family.name!r} has no "
                "tools template; send the request without tools or use a template with tools"
            )
        return self.family.tools_template

    def check(self, template: str | None) -> None:
        """Raise ValueError unless an assistant turn renders as ``... turn_end + turn_sep``."""
        text = self.render(_BASE, None, template=template, add_generation_prompt=False)
        end = "A" + self.family.turn_end + self.family.turn_sep
        if not text.endswith(end):
            raise ValueError(
                f"the chat template does not end an assistant turn with {end[1:]!r} as family "
                f"{self.family.name!r} says (rendered tail {text[-40:]!r}); pass the right "
                f"family (one of {sorted(FAMILIES)})"
            )

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None,
        *,
        template: str | None,
        add_generation_prompt: bool,
    ) -> str:
        """The chat template's text for ``messages`` (template errors become ValueError)."""
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                chat_template=template or self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            )
        except Exception as exc:  # jinja errors (a None content, a bad role) are input errors
            raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens parsed, none added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_turn(
        self, messages: Sequence[Message], tools: Sequence[Any] | None, template: str | None
    ) -> list[int]:
        """Ids of the whole prompt: every message, the tools and the generation prompt."""
        return self.encode(
            self.render(messages, tools, template=template, add_generation_prompt=True)
        )

    def appended_text(
        self, appended: Sequence[Message], tools: Sequence[Any] | None, template: str | None
    ) -> str:
        """The template's text for ``appended`` after an assistant turn, plus the gen prompt."""
        head = self.render(_BASE, tools, template=template, add_generation_prompt=False)
        full = self.render(
            [*_BASE, *appended], tools, template=template, add_generation_prompt=True
        )
        if not full.startswith(head):
            raise ValueError(
                "the chat template renders the earlier turns differently once these messages "
                "are appended, so they cannot be tokenized on their own"
            )
        return full[len(head) :]

    def continuation(
        self,
        appended: Sequence[Message],
        tools: Sequence[Any] | None,
        template: str | None,
        *,
        closed: bool,
    ) -> list[int]:
        """Ids to append after a generated turn: join fix, appended messages, gen prompt.

        Args:
            appended: the new messages (tool results, user turns); may be empty.
            tools: the session's tools.
            template: the session's template (see :meth:`template_for`).
            closed: the generated turn ended with the family's end-of-turn token.
        """
        join = ("" if closed else self.family.turn_end) + self.family.turn_sep
        return self.encode(join + self.appended_text(appended, tools, template))
