"""Reward function failures, the same in both per-sample paths, and through `miles train`.

The paths: ``miles_rollout.generate_rollout`` (the synchronous rollout and the evaluation) and
``miles.rollout.single.generate_sample`` (the asynchronous producer's per-sample call). With
the same engine, prompts and reward function, every policy (``task.reward_errors``: drop,
zero, fail) leaves the same samples in the same state, and a failure names the function and
the sample.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from first_hour_rewards import flaky

from miles.rollout.single import generate_sample
from miles_rollout import (
    ArithmeticTask,
    Engine,
    EngineConfig,
    GenerateContext,
    LocalEngineClient,
    Sample,
    SamplingParams,
    generate_rollout,
)
from miles_rollout.generate import single_turn_generate
from miles_rollout.reward import RewardError

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    eng = Engine(EngineConfig(model_path=str(tiny_model), max_running_requests=16, seed=0))
    yield eng
    eng.shutdown()


def _state(s: Sample) -> tuple[Any, ...]:
    return (s.group_index, s.index, s.status, s.reward is None, "reward_error" in s.metadata)


async def _both(engine: Engine, policy: str) -> tuple[list[Sample], list[Sample]]:
    items = ArithmeticTask(max_operand=9, seed=5).sample(2)
    async with LocalEngineClient(engine) as client:
        rollout = await generate_rollout(
            client,
            engine.tokenizer,
            items,
            n_samples_per_prompt=4,
            sampling_params=PARAMS,
            reward_fn=flaky,
            reward_errors=policy,
        )
        ctx = GenerateContext(client=client, tokenizer=engine.tokenizer, sampling_params=PARAMS)
        singles = [
            await generate_sample(
                ctx,
                Sample(group_index=gi, index=i, prompt=item.messages, label=item.label),
                generate_fn=single_turn_generate,
                reward_fn=flaky,
                reward_errors=policy,
            )
            for gi, item in enumerate(items)
            for i in range(4)
        ]
    return rollout.samples, singles


@pytest.mark.parametrize("policy", ["drop", "zero"])
def test_both_paths_apply_the_policy_alike(engine: Engine, policy: str) -> None:
    rollout, singles = asyncio.run(_both(engine, policy))
    assert [_state(s) for s in rollout] == [_state(s) for s in singles]
    failed = [s for s in rollout if s.index % 2 == 1]
    for s in failed:
        assert s.metadata["reward_error"].startswith(
            "reward function first_hour_rewards:flaky raised ConnectionError("
        )
        assert f"prompt {s.group_index} sample {s.index}: prompt '" in s.metadata["reward_error"]
        assert (s.reward is None) is (policy == "drop")
    assert all(s.reward is not None for s in rollout if s.index % 2 == 0)


def test_fail_raises_in_both_paths(engine: Engine) -> None:
    with pytest.raises(RewardError, match=r"first_hour_rewards:flaky raised ConnectionError"):
        asyncio.run(_both(engine, "fail"))

    async def single_only() -> None:
        item = ArithmeticTask(max_operand=9, seed=5).sample(1)[0]
        async with LocalEngineClient(engine) as client:
            ctx = GenerateContext(client=client, tokenizer=engine.tokenizer, sampling_params=PARAMS)
            await generate_sample(
                ctx,
                Sample(group_index=0, index=1, prompt=item.messages, label=item.label),
                generate_fn=single_turn_generate,
                reward_fn=flaky,
                reward_errors="fail",
            )

    with pytest.raises(RewardError, match=r"prompt 0 sample 1: prompt '\d\+\d='"):
        asyncio.run(single_only())


def _miles(model: Path, out: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    args = ["train", "arith-tiny", "--steps", "2", "--out", str(out), "--no-progress"]
    for s in (
        f"model_path={model}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        *sets,
    ):
        args += ["--set", s]
    return subprocess.run(
        [sys.executable, "-m", "miles", *args], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_miles_train_counts_reward_failures_and_stops_on_a_broken_contract(
    tiny_model: Path, tmp_path: Path
) -> None:
    # A reward that fails on half the samples, policy zero, asynchronous rollout: the run goes
    # on, every failure is counted and the log names the function and the sample.
    run = tmp_path / "zero"
    proc = _miles(
        tiny_model,
        run,
        "rollout.mode=async",
        "task.reward_fn=first_hour_rewards:flaky",
        "task.reward_errors=zero",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/reward_errors"] for r in rows] == [8.0, 8.0]  # 2 of 4 per group, 4 groups
    assert "reward function first_hour_rewards:flaky raised ConnectionError" in proc.stderr
    # A reward that returns a string: one line naming it and the expected type, exit 2.
    run = tmp_path / "text"
    proc = _miles(tiny_model, run, "task.reward_fn=first_hour_rewards:returns_text")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("miles: error: reward function first_hour_rewards:returns_text "), last
    assert "returned str '1.0'" in last
    assert "must return a float" in last
    assert "Traceback" not in proc.stderr
    assert not run.exists()


def test_miles_train_names_a_hung_reward_when_it_stops(tiny_model: Path, tmp_path: Path) -> None:
    # The default task.reward_errors: drop; every reward times out, so every group is dropped
    # and the run stops before training. The stop names the reward first, not the engines.
    run = tmp_path / "hang"
    proc = _miles(
        tiny_model, run, "task.reward_fn=first_hour_rewards:hang", "task.reward_timeout_s=0.5"
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # a run stopped by its guards
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "miles: stopped: step 1: nothing to train on: all 4 groups were dropped: the reward "
        "function first_hour_rewards:hang timed out (task.reward_timeout_s=0.5 s) on 16 of the "
        "step's 16 samples, so their 4 group(s) were dropped (task.reward_errors: drop). "
        "First failure: reward function first_hour_rewards:hang raised RewardTimeoutError("
    ), last
    for fix in ("raise task.reward_timeout_s", "task.reward_errors: zero", "or fail"):
        assert fix in last
    assert "engine" not in last
    assert "Traceback" not in proc.stderr
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()
