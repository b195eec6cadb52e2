"""Contract tests: the signatures users implement (generate, agent, reward functions, tasks and
their factories) and the names a recipe uses. A failure here is a breaking change: update the
docs (README "Extension points") and the changelog together with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import typing
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_fixtures import with_chat_template

from miles_rollout import (
    ArithmeticTask,
    Engine,
    EngineConfig,
    GenerateContext,
    GenerateFn,
    LocalEngineClient,
    MultiTurnGenerate,
    PromptItem,
    Sample,
    SampleStatus,
    SamplingParams,
    Task,
    generate_rollout,
    make_generate_fn,
)
from miles_rollout.generate import single_turn_generate
from miles_rollout.tasks import GuessNumberTask
from miles_rollout.tasks.guess_number import play
from miles_rollout.types import AgentFn, RewardFn, TaskFactory


def _names(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_generate_fn_contract() -> None:
    assert _names(GenerateFn.__call__) == ["self", "ctx", "sample"]
    assert [f.name for f in dataclasses.fields(GenerateContext)] == [
        "client",
        "tokenizer",
        "sampling_params",
        "sessions_url",
        "return_routed_experts",
    ]
    assert _names(single_turn_generate) == ["ctx", "sample"]
    assert inspect.iscoroutinefunction(single_turn_generate)
    assert isinstance(single_turn_generate, GenerateFn)
    gen = MultiTurnGenerate(play)
    assert _names(gen) == ["ctx", "sample"]
    assert inspect.iscoroutinefunction(MultiTurnGenerate.__call__)
    assert gen.needs_sessions is True
    assert not getattr(single_turn_generate, "needs_sessions", False)


def test_agent_reward_and_task_contracts() -> None:
    assert typing.get_args(AgentFn)[0] == [str, Sample, dict[str, Any]]
    assert typing.get_origin(typing.get_args(AgentFn)[1]) is Awaitable
    assert _names(play) == ["base_url", "sample", "request"]
    assert inspect.iscoroutinefunction(play)
    assert typing.get_args(RewardFn)[0] == [Sample]
    assert _names(Task.sample) == ["self", "n"]
    assert _names(Task.reward) == ["self", "response", "label"]
    assert typing.get_args(TaskFactory)[1] is Task
    assert [f.name for f in dataclasses.fields(PromptItem)] == ["messages", "label", "metadata"]
    # The built-in tasks are Tasks, made by their factories from keyword parameters.
    for factory, params in ((ArithmeticTask, {"max_operand": 9}), (GuessNumberTask, {})):
        task = factory(**params)
        assert isinstance(task, Task)
        (item,) = task.sample(1)
        assert isinstance(item, PromptItem)
        assert task.reward(str(item.label), item.label) == 1.0
    assert GuessNumberTask.reward("5\nuser\nhigher\nassistant\nmaybe 9", 9) == 1.0
    assert GuessNumberTask.reward("9\nuser\nlower\nassistant\n4", 9) == 0.0
    with pytest.raises(ValueError, match="max_turns"):
        GuessNumberTask(max_turns=0)


def test_sample_weight_versions() -> None:
    s = Sample(group_index=0, index=0, prompt="p", tokens=[1, 2, 3, 4], response_length=3)
    assert s.weight_version is None
    s.weight_versions = ["9", None, "10"]
    s.loss_mask, s.rollout_logprobs = [1, 0, 1], [-1.0, 0.0, -2.0]
    s.check()
    assert s.weight_version == "10"  # the newest, numerically
    s.weight_versions = ["1"]
    with pytest.raises(ValueError, match="weight_versions"):
        s.check()


async def user_generate(ctx: GenerateContext, sample: Sample) -> Sample:
    """A user's generate function: single-turn, then train only on the first token."""
    sample = await single_turn_generate(ctx, sample)
    sample.loss_mask = [1] + [0] * (sample.response_length - 1)
    sample.metadata["user"] = True
    return sample


def not_async(ctx: GenerateContext, sample: Sample) -> Sample:
    return sample


def test_make_generate_fn_by_name() -> None:
    assert make_generate_fn() is single_turn_generate
    assert make_generate_fn("single_turn") is single_turn_generate
    multi = make_generate_fn("multi_turn", agent="miles_rollout.tasks.guess_number:play")
    assert isinstance(multi, MultiTurnGenerate)
    assert multi.agent is play
    assert make_generate_fn("test_contracts:user_generate").__name__ == "user_generate"
    for kwargs, match in (
        ({"name": "multi_turn"}, "needs an agent"),
        ({"name": None, "agent": "x:y"}, "only used with"),
        ({"name": "test_contracts:not_async"}, "must be an async function"),
        ({"name": "no_such_module:f"}, "cannot import"),
        ({"name": "test_contracts:missing"}, "no callable"),
        ({"name": "multi_turn", "agent": "test_contracts:not_async"}, "async function"),
    ):
        with pytest.raises(ValueError, match=match):
            make_generate_fn(**kwargs)


@pytest.fixture(scope="module")
def chat_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = with_chat_template(model_dir, tmp_path_factory.mktemp("c") / "tiny-chat")
    eng = EngineConfig(model_path=str(path), max_running_requests=16, seed=0).build()
    yield eng
    eng.shutdown()


def test_a_user_generate_fn_by_dotted_path_runs_in_the_rollout(chat_engine: Engine) -> None:
    task = ArithmeticTask(max_operand=9, seed=3)
    result = asyncio.run(
        generate_rollout(
            LocalEngineClient(chat_engine),
            chat_engine.tokenizer,
            task.sample(2),
            n_samples_per_prompt=2,
            sampling_params=SamplingParams(max_new_tokens=4, temperature=1.0),
            reward_fn=lambda s: task.reward(s.response, s.label),
            generate_fn=make_generate_fn("test_contracts:user_generate"),
        )
    )
    for s in result.samples:
        s.check()
        assert s.metadata["user"] is True
        assert s.loss_mask == [1] + [0] * (s.response_length - 1)
        assert s.weight_versions == ["0"] * s.response_length
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert s.reward in (0.0, 1.0)
