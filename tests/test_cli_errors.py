"""One error path per console script (issue 31): each case the issue lists prints one line that
names the problem and the fix, exits 2, and shows no traceback unless ``--debug``.

In-process ``main()`` calls (the entry points' own functions) plus one run of the installed
``miles`` script in its own process. miles-rollout's cases (a busy port, a damaged checkpoint
for ``serve``) are in its package tests; the offload manifest's in miles-offload's.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from miles.cli import main as miles_main
from miles_env.cli import main as env_main
from miles_quant.checkpoint_cli import main as quant_main


def one_line(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    """The single non-empty stderr line, which must start with ``prefix``."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def damaged(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``damaged(kind)``: a copy of the tiny model with one file broken."""
    root = tmp_path_factory.mktemp("damaged")

    def make(kind: str) -> Path:
        out = root / kind
        if out.exists():
            return out
        shutil.copytree(tiny_model, out)
        if kind == "config":
            (out / "config.json").write_text('{"model_type": "qwen3", ')
        elif kind == "config-list":
            (out / "config.json").write_text("[1, 2]")
        elif kind == "weights":
            (out / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{oops")
        elif kind == "truncated":
            data = (out / "model.safetensors").read_bytes()
            (out / "model.safetensors").write_bytes(data[: len(data) // 2])
        elif kind == "index":
            (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
        elif kind == "index-null":
            (out / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"lm_head.weight": None}})
            )
        else:
            raise AssertionError(kind)
        return out

    return make


@pytest.fixture
def refusing_url() -> Iterator[str]:
    """A loopback URL that refuses connections while the test runs (bound, not listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


# ---- miles ------------------------------------------------------------------------------------


def test_miles_set_value_that_is_not_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert miles_main(["train", "arith-tiny", "--set", "trainer.lr=["]) == 2
    line = one_line(capsys, "miles: error: ")
    assert "override 'trainer.lr=['" in line
    assert "not valid YAML" in line
    assert "quote a string" in line  # the fix


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("config", "config.json is not valid JSON"),
        ("config-list", "config.json is not a JSON object"),
        ("weights", "model.safetensors is not a readable safetensors file"),
        ("truncated", "model.safetensors is not a readable safetensors file"),
    ],
)
def test_miles_train_on_a_damaged_checkpoint(
    damaged: Callable[[str], Path], kind: str, expected: str, tmp_path: Path, capsys
) -> None:
    argv = ["train", "arith-tiny", "--set", f"model_path={damaged(kind)}", "--out", str(tmp_path)]
    assert miles_main(argv) == 2
    line = one_line(capsys, "miles: error: ")
    assert expected in line
    assert "save_pretrained" in line
    assert not any(tmp_path.iterdir())  # no half-made run directory


def test_miles_train_with_an_unreachable_engine(
    tiny_model: Path, refusing_url: str, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    argv = ["train", "arith-tiny", "--set", f"model_path={tiny_model}", "--out", str(out)]
    argv += ["--set", f"rollout.engine_url={refusing_url}", "--no-progress"]
    assert miles_main(argv) == 2
    line = one_line(capsys, "miles: error: ")
    assert f"cannot reach the engine at rollout.engine_url={refusing_url}" in line
    assert "start it first" in line
    assert not out.exists()


def test_miles_python_recipe_that_raises(tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(
        "def helper():\n"
        "    return {}['model_path']\n"
        "\n"
        "def recipe():\n"
        "    return {'model_path': helper()}\n"
    )
    assert miles_main(["train", str(recipe)]) == 2
    line = one_line(capsys, "miles: error: ")
    assert f"recipe() in {recipe} raised KeyError: 'model_path' at line 2" in line
    assert "--debug" in line
    recipe.write_text("def recipe(:\n")
    assert miles_main(["train", str(recipe)]) == 2
    line = one_line(capsys, "miles: error: ")
    assert f"recipe file {recipe} failed to import: SyntaxError" in line
    assert "at line 1" in line


def test_miles_debug_shows_the_traceback(tmp_path: Path) -> None:
    recipe = tmp_path / "r.py"
    recipe.write_text("def recipe():\n    raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="RuntimeError: boom") as info:
        miles_main(["--debug", "train", str(recipe)])
    assert isinstance(info.value.__cause__, RuntimeError)  # the user's own error, chained
    with pytest.raises(ValueError, match="not valid YAML"):
        miles_main(["train", "arith-tiny", "--set", "trainer.lr=[", "--debug"])


def test_miles_console_script_prints_one_line(tmp_path: Path) -> None:
    """The installed entry point in its own process (no torch import before the error)."""
    proc = subprocess.run(
        [sys.executable, "-m", "miles", "train", "arith-tiny", "--set", "trainer.lr=["],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("miles: error: override 'trainer.lr=['")


# ---- miles-quant-checkpoint -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("weights", "model.safetensors is not a readable safetensors file"),
        ("truncated", "model.safetensors is not a readable safetensors file"),
        ("index", "model.safetensors.index.json has no 'weight_map' object"),
        ("index-null", "weight_map['lm_head.weight'] = None is not a shard file name"),
    ],
)
def test_quant_checkpoint_on_damaged_input(
    damaged: Callable[[str], Path], kind: str, expected: str, tmp_path: Path, capsys
) -> None:
    dst = tmp_path / "out"
    assert quant_main([str(damaged(kind)), str(dst), "-f", "fp8_block128", "--no-progress"]) == 2
    line = one_line(capsys, "miles-quant-checkpoint: error: ")
    assert expected in line
    assert not dst.exists()  # nothing half-written
    with pytest.raises(ValueError, match=re.escape(expected)):
        quant_main([str(damaged(kind)), str(dst), "-f", "fp8_block128", "--debug"])


# ---- miles-env --------------------------------------------------------------------------------


def test_env_check_on_a_missing_directory(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "no-tasks-here"
    assert env_main(["check", str(missing)]) == 2
    line = one_line(capsys, "miles-env: error: ")
    assert str(missing) in line
