"""Recipe loading: built-in, YAML and Python recipes, overrides, and the errors users see."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles.config import RunConfig, builtin_recipes, load_recipe


def test_builtin_recipe_loads_with_overrides(tmp_path: Path) -> None:
    cfg = load_recipe(
        "arith-tiny",
        [
            f"model_path={tmp_path}",
            "trainer.lr=3e-4",
            "trainer.loss.clip_high=0.3",
            "run.num_steps=7",
        ],
    )
    assert "arith-tiny" in builtin_recipes()
    assert cfg.model_path == str(tmp_path)
    assert cfg.engine.model_path == cfg.trainer.model_path == str(tmp_path)
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.trainer.loss.clip_high == pytest.approx(0.3)
    assert cfg.run.num_steps == 7


def test_a_decaying_lr_spans_the_run_unless_its_length_is_set(tmp_path: Path) -> None:
    base = [f"model_path={tmp_path}", "run.num_steps=10", "trainer.num_minibatches=2"]
    sched = ["trainer.lr_decay_style=cosine", "trainer.lr_warmup_steps=4"]
    cfg = load_recipe("arith-tiny", base + sched)
    assert cfg.trainer.lr_decay_steps == 10 * 2 - 4  # every optimizer step after the warm-up
    assert cfg.trainer.lr_at(10**6) == cfg.trainer.min_lr == 0.0
    assert (
        load_recipe(
            "arith-tiny", [*base, *sched, "trainer.lr_decay_steps=7"]
        ).trainer.lr_decay_steps
        == 7
    )
    assert load_recipe("arith-tiny", base).trainer.lr_decay_steps is None  # constant
    with pytest.raises(ValueError, match="lr_decay_style must be one of"):
        load_recipe("arith-tiny", [*base, "trainer.lr_decay_style=exp"])


def test_yaml_recipe_round_trips_through_to_dict(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model_path: /models/x\n"
        "sampling: {temperature: 0.7, max_new_tokens: 16}\n"
        "trainer: {lr: 1.0e-5, betas: [0.9, 0.95], loss: {kl_coef: 0.01, kl_type: k1}}\n"
        "rollout: {prompts_per_step: 4, n_samples_per_prompt: 4}\n"
    )
    cfg = load_recipe(str(recipe))
    assert cfg.name == "r"
    assert cfg.trainer.betas == (0.9, 0.95)
    assert cfg.trainer.loss.kl_type == "k1"
    assert cfg.sampling.temperature == pytest.approx(0.7)
    again = RunConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


def test_python_recipe(tmp_path: Path) -> None:
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text("def recipe():\n    return {'model_path': '/m', 'run': {'num_steps': 3}}\n")
    assert load_recipe(str(recipe)).run.num_steps == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["bogus=1"], "unknown recipe key bogus"),
        (["trainer.lrr=0.1"], "unknown recipe key trainer.lrr; valid keys in 'trainer': dtype, lr"),
        (["trainer.loss.kl_typ=k1"], "trainer.loss.kl_typ"),
        (["trainer.lr=fast"], "trainer.lr: expected a number, got 'fast'"),
        (["trainer.model_path=/x"], "trainer.model_path cannot be set here"),
        (["trainer.loss.kl_type=k9"], "kl_type must be one of"),
        (["rollout.n_samples_per_prompt=1"], "n_samples_per_prompt must be >= 2"),
        (["sampling.top_k=0"], "top_k must be -1"),
        (["run.num_steps=0"], "num_steps must be >= 1"),
        (["model_path="], "must set model_path"),
        (["nolevel"], "must look like section.key=value"),
    ],
)
def test_bad_values_name_the_problem(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe("arith-tiny", overrides)


def test_malformed_and_missing_recipe_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_path: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_recipe(str(bad))
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        load_recipe(str(scalar))
    section = tmp_path / "section.yaml"
    section.write_text("model_path: /m\ntrainer: 3\n")
    with pytest.raises(ValueError, match="section 'trainer' must be a mapping"):
        load_recipe(str(section))
    with pytest.raises(FileNotFoundError, match="recipe file not found"):
        load_recipe(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=r"unknown recipe 'nope'.*arith-tiny"):
        load_recipe("nope")


def test_the_demo_recipe_is_arith_tiny_with_heldout_evaluation_and_a_decaying_lr(
    tmp_path: Path,
) -> None:
    demo = load_recipe("arith-demo", [f"model_path={tmp_path}"])
    base = load_recipe("arith-tiny", [f"model_path={tmp_path}"])
    assert demo.eval.mode == "shared"
    assert (demo.eval.num_prompts, demo.eval.sampled_n) == (200, 4)
    assert (demo.run.eval_every, demo.run.num_steps) == (50, 300)
    assert base.run.eval_every == 0
    # Its own optimisation: two optimizer steps per batch, lr 3e-4 decayed along a cosine to
    # 3e-5 over the run (300 steps x 2); otherwise arith-tiny's trainer.
    assert (demo.trainer.num_minibatches, demo.trainer.lr, demo.trainer.min_lr) == (2, 3e-4, 3e-5)
    assert (demo.trainer.lr_decay_style, demo.trainer.lr_decay_steps) == ("cosine", 600)
    assert demo.trainer.loss == base.trainer.loss
    assert demo.trainer.micro_batch_size == base.trainer.micro_batch_size
    assert demo.task == base.task
