"""`miles train --ray` before Ray starts: the recipe's `ray` section, the launch plan's checks,
rank errors carried across processes, and the command line. No Ray is started here (the runs
are in tests/test_e2e_ray.py)."""

from __future__ import annotations

import pickle
import sys

import pytest

from miles.cli import _expected, main
from miles.config import load_recipe
from miles.ray.launcher import plan
from miles.ray.trainer import RankError, _portable
from miles_rollout.reward import RewardError


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ray.trainer_ranks=0", "ray.trainer_ranks must be >= 1"),
        ("ray.gpus_per_rank=2", "ray.gpus_per_rank must be 0 (CPU), 1 (a GPU per rank)"),
        ("ray={trainer_ranks: 2, gpus_per_rank: 0.5}", "could put two of the 2 ranks"),
        ("ray.cpus_per_engine=-1", "ray.cpus_per_engine must be >= 0"),
        ("ray.strategy=pack", "ray.strategy must be one of PACK"),
        ("ray.engine_host=public", "ray.engine_host must be 'loopback' or 'node'"),
        ("ray.env={A: 1}", "ray.env values must be strings; quote A"),
        ("ray.trainer_rank=2", "unknown recipe key ray.trainer_rank"),
    ],
)
def test_ray_section_names_the_bad_key(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe("arith-tiny", [override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.backend=megatron", "trainer.megatron.tp=2", "ray.trainer_ranks=3"],
            "ray.trainer_ranks=3: 3 ranks cannot hold MegatronConfig tp=2",
        ),
        (
            ["fleet={engines: 2}", "ray.engine_host=node"],
            "ray.engine_host=node binds every engine to its node's address",
        ),
        (["ray.cpus_per_rank=0"], "ray.cpus_per_rank and ray.gpus_per_rank are both 0"),
        (
            ["fleet={engines: 1, launcher: 'my.k8s:Launcher'}"],
            "--ray places them as Ray actors: unset fleet.launcher",
        ),
    ],
)
def test_plan_refuses_what_cannot_run(
    overrides: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MILES_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(load_recipe("arith-tiny", overrides))


def test_plan_sizes_the_bundles() -> None:
    cfg = load_recipe(
        "arith-tiny",
        [
            "ray.trainer_ranks=4",
            "ray.gpus_per_rank=1",
            "ray.cpus_per_rank=2",
            "fleet={engines: 2, backend: sglang, sglang_args: {tp_size: 2}}",
        ],
    )
    p = plan(cfg)
    assert (p.ranks, p.rank_bundle) == (4, {"CPU": 2.0, "GPU": 1.0})
    # gpus_per_engine unset: what one SGLang engine of tp_size 2 occupies.
    assert (p.engines, p.engine_bundle) == (2, {"CPU": 1.0, "GPU": 2.0})
    assert p.total("GPU") == 8.0
    keyed = load_recipe("arith-tiny", ["fleet={engines: 1, api_key: k}", "ray.engine_host=node"])
    assert plan(keyed).engine_bundle == {"CPU": 1.0}


def test_config_yaml_keeps_the_recipe_not_the_placement() -> None:
    """A resumed run is placed by its own command line, with or without --ray."""
    cfg = load_recipe(
        "arith-tiny",
        ["fleet={engines: 1, launcher: 'miles.ray.fleet:RayLauncher', launcher_args: {a: 1}}"],
    )
    fleet = cfg.to_dict()["fleet"]
    assert (fleet["launcher"], fleet["launcher_args"]) == (None, {})


def test_an_unpicklable_rank_error_arrives_as_itself() -> None:
    """RewardError takes a keyword-only argument, so it does not unpickle; the launcher still
    raises an exception of that name, base and message, and the command line reports it as it
    would without Ray (one line, exit 2)."""
    original = RewardError("reward function f returned str", function="f")
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(original))
    carried = _portable(original)
    assert isinstance(carried, RankError)
    rebuilt = pickle.loads(pickle.dumps(carried)).rebuild()
    assert type(rebuilt).__name__ == "RewardError"
    assert isinstance(rebuilt, RuntimeError)
    assert str(rebuilt) == "reward function f returned str"
    assert _expected(rebuilt)
    plain = FileNotFoundError("model directory not found: /x")
    assert _portable(plain) is plain  # picklable errors travel as they are


def test_ray_missing_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.ray._import import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'miles\[ray\]'"):
        import_ray()


def test_ray_before_the_recipe_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--ray", "arith-tiny"]) == 2
    err = capsys.readouterr().err
    assert "--ray took 'arith-tiny' as the Ray address: write the recipe before --ray" in err
