"""End to end: every weight-transfer method of `miles train` (``transfer.method``), through the CLI.

- ``delta`` with the embedded engine (bf16, RL learning rate): step 1 ships a full snapshot,
  later steps only the changed elements, and the engine's digests equal the published weights.
- ``p2p`` over two trainer processes into the embedded engine: each rank sends only its own
  shard (FSDP2, or Megatron TP 2); the engine receives its whole layout, checked bit for bit in
  two hops.
- both against a ``miles-rollout serve`` process: ``p2p`` through a ``miles-transfer p2p-agent``
  the loop starts beside it, ``delta`` through ``update_weights_from_disk`` of versions
  materialized on the same filesystem.
- ``colocated`` from two trainer processes into the embedded engine: rank 0 (on the engine's
  device) shares its copy in shared memory, one payload per engine TP rank, through the
  engine's own ``/update_weights_from_tensor`` on a loopback server, verified bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytest.importorskip("xxhash")  # miles-transfer[delta]


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(Path(__file__).parent)]),
    )


def _train(model: Path, out: Path, steps: int, *sets: str, torchrun: int = 0) -> None:
    args = ["train", "arith-tiny", "--steps", str(steps), "--out", str(out), "--no-progress"]
    for s in (
        f"model_path={model}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "task.reward_fn=e2e_rewards:response_parity",
        *sets,
    ):
        args += ["--set", s]
    launcher = [sys.executable, "-m"]
    if torchrun:
        launcher += ["torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}", "-m"]
    # Output to a file: torch's shared-memory manager may outlive the run (see the HTTP test).
    log = out.parent / f"{out.name}.log"
    with log.open("w") as fh:
        proc = subprocess.run(
            [*launcher, "miles", *args], env=_env(), stdout=fh, stderr=subprocess.STDOUT,
            timeout=600,
        )  # fmt: skip
    assert proc.returncode == 0, log.read_text()[-3000:]


def _updates(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k[len("update/") :]: v for k, v in r.items() if k.startswith("update/")} for r in rows]


def _param_bytes(model: Path, itemsize: int) -> int:
    """Bytes of the model's unique tensors at ``itemsize`` bytes per element."""
    return sum(t.numel() * itemsize for t in load_file(model / "model.safetensors").values())


def test_delta_ships_a_few_percent_after_the_first_step(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "delta"
    _train(
        tiny_model, run, 3,
        "transfer.method=delta", "engine.dtype=bfloat16", "trainer.lr=1e-6",
    )  # fmt: skip
    ups = _updates(run)
    assert [u["weight_version"] for u in ups] == ["1", "2", "3"]
    full = _param_bytes(tiny_model, 2)  # the bf16 weights the engine serves
    assert all(u["method"] == "delta" and u["verified"] is True for u in ups)
    assert all(u["full_bytes"] == full for u in ups)
    assert ups[0]["kind"] == "full"
    assert ups[0]["bytes"] == full
    for u in ups[1:]:
        assert u["kind"] == "delta"
        assert u["bytes"] == u["delta_bytes"] < full / 10, u
        assert 0 < u["changed_fraction"] < 0.1
        assert u["raw_bytes"] == pytest.approx(u["changed_fraction"] * full, rel=1e-6)
        assert u["pause_s"] > 0
    published = sorted(p.name for p in (run / "weights").iterdir() if p.is_dir())
    assert published == ["weight_v000001", "weight_v000002", "weight_v000003"]


@pytest.mark.parametrize(
    "backend",
    [
        [],
        # Megatron TP 2: fused QKV and gate/up, padded vocabulary, re-sharded on the way.
        pytest.param(["trainer.backend=megatron", "trainer.megatron.tp=2"], marks=pytest.mark.slow),
    ],
    ids=["fsdp", "megatron-tp2"],
)
def test_p2p_from_two_trainer_processes(
    tiny_model: Path, tmp_path: Path, backend: list[str]
) -> None:
    run = tmp_path / "p2p"
    _train(tiny_model, run, 2, "transfer.method=p2p", *backend, torchrun=2)
    ups = _updates(run)
    assert [u["weight_version"] for u in ups] == ["1", "2"]
    engine_bytes = _param_bytes(tiny_model, 4)  # fp32 engine, tied embedding moved once
    for u in ups:
        assert u["method"] == "p2p"
        assert u["verified"] is True
        assert u["bytes"] == engine_bytes  # the engine's layout, nothing moved twice
        assert 0 < u["sent_bytes"] < engine_bytes  # rank 0 sent only its own shard
        assert u["pause_s"] > 0


def _served_bytes(model: Path, itemsize: int) -> int:
    """Bytes of every weight the engine serves (a tied lm_head counted again, as it is sent)."""
    config = json.loads((model / "config.json").read_text())
    tensors = load_file(model / "model.safetensors")
    tied = tensors["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else None
    return _param_bytes(model, itemsize) + (tied.numel() * itemsize if tied is not None else 0)


COLOCATED = ("transfer.method=colocated", "transfer.colocated.allow_pickle_weights=true")


def test_colocated_from_two_trainer_processes(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "colocated"
    _train(tiny_model, run, 2, *COLOCATED, torchrun=2)
    ups = _updates(run)
    assert [u["weight_version"] for u in ups] == ["1", "2"]
    for u in ups:
        assert (u["method"], u["verified"], u["payloads"]) == ("colocated", True, 1)
        assert u["bytes"] == _served_bytes(tiny_model, 4)  # fp32 engine: every weight once
        assert u["engine_pause_s"] > 0


@pytest.mark.slow  # a server process and two runs: about a minute here
def test_p2p_and_delta_into_a_server_process(tiny_model: Path, tmp_path: Path) -> None:
    server_log = tmp_path / "server.log"
    with server_log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "miles_rollout.cli", "serve", "--model-path", str(tiny_model),
             "--port", "0"],
            env=_env(), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline and server.poll() is None:
            m = re.search(r"at (http://127\.0\.0\.1:\d+)", server_log.read_text())
            if m:
                url = m.group(1)
            else:
                time.sleep(0.2)
        assert url, f"server did not start: {server_log.read_text()[-2000:]}"
        engine_bytes = _param_bytes(tiny_model, 4)

        run = tmp_path / "p2p"
        _train(tiny_model, run, 2, "transfer.method=p2p", f"rollout.engine_url={url}")
        ups = _updates(run)
        assert [u["weight_version"] for u in ups] == ["1", "2"]
        assert all(u["verified"] is True and u["bytes"] == engine_bytes for u in ups)

        run = tmp_path / "delta"
        _train(tiny_model, run, 2, "transfer.method=delta", f"rollout.engine_url={url}")
        ups = _updates(run)
        assert [u["weight_version"] for u in ups] == ["1", "2"]
        assert all(u["verified"] is True for u in ups)
        assert ups[-1]["kind"] == "delta"
        assert ups[-1]["bytes"] == ups[-1]["delta_bytes"] < ups[-1]["full_bytes"]
        with urllib.request.urlopen(f"{url}/get_model_info", timeout=30) as resp:
            info = json.loads(resp.read())
        # The server reloaded the version materialized for it on the shared filesystem.
        assert info["weight_version"] == "2"
        assert info["model_path"] == str((run / "weights" / "engine" / "weight_v000002").resolve())
    finally:
        server.terminate()
        server.wait(timeout=30)
