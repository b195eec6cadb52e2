"""Chat templates written for this project (Jinja data, rendered by transformers).

- ``QWEN3_TEMPLATE``: Qwen3's prompt format. A system block that lists the tools inside
  ``<tools></tools>`` and asks for ``<tool_call>`` JSON; assistant turns with their tool calls;
  consecutive ``tool`` messages grouped into one user turn of ``<tool_response>`` blocks;
  ``reasoning_content`` of the turns after the last user query in a ``<think>`` block, dropped
  for earlier turns (as Qwen3 does; one reason why re-rendering a history is not append-only);
  ``enable_thinking=False`` adds an empty think block to the generation prompt.
- ``CHATML_TOOLS_TEMPLATE``: the same tool format without think blocks, for ChatML models whose
  own template ignores ``tools`` (SmolLM2-135M-Instruct's does).

Both close every turn with ``<|im_end|>`` followed by a newline the model never generates.
"""

from __future__ import annotations

__all__ = ["CHATML_TOOLS_TEMPLATE", "QWEN3_TEMPLATE"]

_TOOLS_SYSTEM = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)

_TOOL_CALLS = (
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if loop.first and not body %}{{- '<tool_call>\\n' }}"
    "{%- else %}{{- '\\n<tool_call>\\n' }}{%- endif %}"
    '{{- \'{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
)

_TOOL_RESULT = (
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
)


def _template(think: bool) -> str:
    last_query = (
        "{%- set ns = namespace(last_query=-1) %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
        "{%- endfor %}"
    )
    if think:
        assistant_head = (
            "{%- set reasoning = message.reasoning_content "
            "if message.reasoning_content is defined and message.reasoning_content else '' %}"
            "{{- '<|im_start|>assistant\\n' }}"
            "{%- if reasoning and loop.index0 > ns.last_query %}"
            "{{- '<think>\\n' + reasoning.strip() + '\\n</think>\\n\\n' }}{%- endif %}"
        )
        gen_prompt = (
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and enable_thinking is false %}"
            "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
        )
    else:
        assistant_head = "{{- '<|im_start|>assistant\\n' }}"
        gen_prompt = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    return (
        _TOOLS_SYSTEM
        + last_query
        + "{%- for message in messages %}"
        + "{%- if message.role == 'system' and loop.first %}"
        + "{%- elif message.role == 'user' or message.role == 'system' %}"
        + "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        + "{%- elif message.role == 'assistant' %}"
        + "{%- set body = message.content if message.content else '' %}"
        + assistant_head
        + "{{- body }}"
        + _TOOL_CALLS
        + "{{- '<|im_end|>\\n' }}"
        + "{%- elif message.role == 'tool' %}"
        + _TOOL_RESULT
        + "{%- endif %}"
        + "{%- endfor %}"
        + gen_prompt
    )


QWEN3_TEMPLATE = _template(think=True)
CHATML_TOOLS_TEMPLATE = _template(think=False)
