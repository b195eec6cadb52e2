"""HUD's own agent loop under ``miles train``: ``task.name: hud`` lists the task rows of a HUD
environment (in HUD's Python, through miles_env's bridge), ``rollout.agent:
miles_env.integrations.hud:hud_agent`` plays each with HUD's ``OpenAIChatAgent`` and episode
driver (``hud.eval.run.rollout``, the environment served on loopback by HUD's
``LocalRuntime``) against the run's TITO session server as it would call any provider; the
session keeps the token ids and the loss mask, HUD's grade comes back as the reward, and the
samples are trained.

The model is a tiny random Llama with SmolLM2's tokenizer and ChatML template: what it says is
noise, so the test checks the path (what reached the session, what HUD graded, what was
trained), not skill.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import save_tiny_smol

pytest.importorskip("miles_env")

from miles_env.integrations.hud import HudAgent, hud_python

# Two task rows of two templates: a grade object and a bare number. Each grade is also written
# to graded.jsonl, so the test can tell HUD graded exactly the replies the sessions generated.
ENV = """
import json
from pathlib import Path

import hud

env = hud.Environment("arith")
GRADED = Path(__file__).with_name("graded.jsonl")


def _graded(template, answer, score):
    with GRADED.open("a") as f:
        f.write(json.dumps({"template": template, "answer": str(answer), "score": score}) + "\\n")


@env.template(id="add", description="Add two integers.")
async def add(a: int, b: int):
    answer = yield f"What is {a} + {b}? Answer with the number only."
    score = 1.0 if str(a + b) in str(answer) else 0.0
    _graded("add", answer, score)
    yield {"score": score, "content": "right" if score else f"expected {a + b}"}


@env.template(id="speak")
async def speak():
    answer = yield "Say something."
    score = 1.0 if str(answer).strip() else 0.0
    _graded("speak", answer, score)
    yield score


tasks = [add(a=3, b=4), speak()]
"""

PROMPTS = {
    "add": "What is 3 + 4? Answer with the number only.",
    "speak": "Say something.",
}


def test_hud_agent_without_an_environment_says_how_to_name_one() -> None:
    with pytest.raises(ValueError, match="needs a HUD environment"):
        asyncio.run(HudAgent(python="/nope/python")("http://x", SimpleNamespace(label="add"), {}))


def _miles_train(recipe: Path, run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``miles train RECIPE`` through the CLI's entry point, in this process (the run's
    imports are this process's: about 10 s less than a fresh ``python -m miles``)."""
    from miles.cli import main as miles_main

    monkeypatch.chdir(recipe.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the recipe's folder is added to it
    assert miles_main(["train", str(recipe), "--out", str(run), "--no-progress"]) == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_miles_train_runs_hud_agent_on_a_hud_taskset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """``miles train`` (the CLI's entry point, ``miles.cli.main``), one step: both rows, two
    episodes each."""
    try:
        hud_python()
    except FileNotFoundError as e:
        pytest.skip(f"hud is not installed: run tools/setup_agent_frameworks.sh ({e})")
    model = save_tiny_smol(tmp_path / "tiny-smol")
    (tmp_path / "arith_env.py").write_text(textwrap.dedent(ENV))
    recipe = tmp_path / "hud_e2e.py"
    recipe.write_text(
        textwrap.dedent(
            f"""
            def recipe():
                return {{
                    "name": "hud-e2e",
                    "model_path": {str(model)!r},
                    "engine": {{"dtype": "float32", "max_running_requests": 4}},
                    "sampling": {{"temperature": 1.0, "max_new_tokens": 12}},
                    "trainer": {{"lr": 1e-4, "dtype": "float32", "micro_batch_size": 4}},
                    "rollout": {{
                        "prompts_per_step": 2,
                        "n_samples_per_prompt": 2,
                        "generate_fn": "multi_turn",
                        "agent": "miles_env.integrations.hud:hud_agent",
                    }},
                    "task": {{
                        "name": "hud",
                        "params": {{"source": "arith_env.py", "max_turns": 2}},
                        "reward_fn": "miles_env.rollout:episode_reward",
                    }},
                    "run": {{"num_steps": 1, "dump_samples": True}},
                }}
            """
        )
    )
    run = tmp_path / "run"
    _miles_train(recipe, run, monkeypatch)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]  # no HUD teardown noise
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1
    assert row["rollout/failed_frac"] == 0.0, row
    assert row["rollout/reward_errors"] == 0.0, row  # HUD graded every episode
    assert row["rollout/agentic/turns"] == 1.0  # an answer without tool calls ends it
    assert row["rollout/agentic/tool_calls"] == 0.0
    # Rewards by task row: HUD's slugs (the template id, then a hash of the args).
    by_task = sorted(k.rsplit("/", 1)[1] for k in row if k.startswith("rollout/agentic/reward/"))
    assert [t.split("-")[0] for t in by_task] == ["add", "speak"], by_task
    assert row["rollout/agentic/reward/speak"] == 1.0  # 12 tokens of noise are not empty
    assert row["train/samples"] == 4.0
    assert row["train/loss"] == row["train/loss"]  # trained (finite)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    trained = []
    for s in samples:
        tokens, mask = s["tokens"], s["loss_mask"]
        first = mask.index(1)
        prompt = tok.decode(tokens[:first])
        # What HUD's agent sent through the session: the template's prompt, which only HUD's
        # runtime produces (the task set's item only describes the row, and never got here).
        (template,) = [t for t, text in PROMPTS.items() if text in prompt]
        assert "HUD task" not in prompt
        # One reply, generated: the loss mask and weight versions mark exactly its tokens.
        assert mask[first:] == [1] * (len(mask) - first)
        assert 1 <= len(mask) - first <= 12
        assert all((v is None) == (m == 0) for v, m in zip(s["weight_versions"], mask))
        reply = str(tok.decode(tokens[first:], skip_special_tokens=True)).strip()
        trained.append((template, reply, s["reward"]))
    # HUD graded exactly the replies the sessions generated, and its grades are the rewards.
    graded = [json.loads(line) for line in (tmp_path / "graded.jsonl").read_text().splitlines()]
    assert sorted(trained) == sorted(
        (g["template"], g["answer"].strip(), g["score"]) for g in graded
    )
    assert row["rollout/reward_mean"] == pytest.approx(sum(r for *_, r in trained) / 4)
