"""First-hour traps with an external engine (`rollout.engine_url`), through the real CLI.

One `miles-rollout serve` process serves a policy with *other weights* than the recipe's (the
same tiny model, perturbed). Each trap is reproduced as a new user meets it:

- step 1 would train on the other policy's samples: the pre-flight push at version 0 makes the
  train/rollout logprob gap of step 1 that of the recipe's own weights;
- a recipe whose model differs from the served one stops before any rollout, naming both;
- `miles train ... 2>&1 | tail` hung after the run while the server was up (the trainer's
  `torch_shm_manager` child held the pipe): the pipe now ends when the run does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import load_tool
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow  # a server plus three short `miles train` runs: ~1 min


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def other_weights(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe's model with every weight perturbed: same architecture, another policy."""
    out = tmp_path_factory.mktemp("other") / "other-weights"
    shutil.copytree(tiny_model, out)
    gen = torch.Generator().manual_seed(7)
    tensors = load_file(out / "model.safetensors")
    for name, t in tensors.items():
        tensors[name] = t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def server_url(other_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("w") as out:  # a file: an undrained pipe could fill and block it
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "miles_rollout.cli",
                "serve",
                "--model-path",
                str(other_weights),
                "--port",
                "0",
            ],
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline and server.poll() is None:
            m = re.search(r"at (http://127\.0\.0\.1:\d+)", log.read_text())
            url = m.group(1) if m else None
            if url is None:
                time.sleep(0.2)
        assert url, f"server did not start: {log.read_text()[-2000:]}"
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def _train_args(model: Path, url: str, run: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miles",
        "train",
        "arith-tiny",
        "--set",
        f"model_path={model}",
        "--set",
        f"rollout.engine_url={url}",
        "--set",
        "rollout.prompts_per_step=4",
        "--set",
        "rollout.n_samples_per_prompt=4",
        "--steps",
        "1",
        "--out",
        str(run),
        "--no-progress",
    ]


def test_preflight_pushes_the_trainers_weights_and_the_pipe_ends_with_the_run(
    tiny_model: Path, server_url: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # stdout and stderr into one pipe, as `miles train ... 2>&1 | tail` does.
    proc = subprocess.Popen(
        _train_args(tiny_model, server_url, run),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    chunks: list[bytes] = []
    eof = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 65536):
            chunks.append(chunk)
        eof.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert proc.wait(timeout=600) == 0, b"".join(chunks).decode()[-3000:]
    # The run is over and the server is still up: the pipe must reach its end anyway.
    ended = eof.wait(timeout=60)
    assert ended, "the output pipe stayed open after `miles train` exited (inherited by a child)"
    out = b"".join(chunks).decode()
    assert "run directory:" in out
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Step 1 sampled from the trainer's own weights (pushed and verified at version 0); with
    # the server's perturbed weights this gap is ~0.1-0.4.
    assert row["train/train_rollout_logprob_abs_diff"] < 1e-3, row
    assert row["update/verified"] is True


def test_a_recipe_with_another_model_stops_before_any_rollout(
    server_url: str, tmp_path: Path
) -> None:
    tool = load_tool("make_tiny_model")
    model = tool.build(tool.TinyModelSpec(num_layers=1, sft_steps=1), tmp_path / "one-layer")
    run = tmp_path / "run"
    proc = subprocess.run(
        _train_args(model, server_url, run),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"the engine at {server_url} serves another model" in proc.stderr
    assert "num_hidden_layers 2 (recipe's model: 1)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run.exists()
