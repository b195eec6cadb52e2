"""End to end over HTTP: `miles train` drives a separate engine process through SGLang's API.

The engine is `miles-rollout serve` (our server implementing SGLang's native endpoints); the
loop generates with `SGLangClient`, pushes weights with `HTTPReceiver` through
`/update_weights_from_tensor` (SGLang's wire format) and verifies them with the Miles
`/weights_checksum` extension. A real SGLang server cannot run on the CPU machine.
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


def test_train_against_an_http_engine(tiny_model: Path, tmp_path: Path) -> None:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    server_log = tmp_path / "server.log"
    with server_log.open("w") as out:  # a file: an undrained pipe could fill and block it
        server = subprocess.Popen(
            [sys.executable, "-m", "miles_rollout.cli", "serve", "--model-path", str(tiny_model)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline and server.poll() is None:
            m = re.search(r"at (http://127\.0\.0\.1:\d+)", server_log.read_text())
            if m:
                url = m.group(1)
            else:
                time.sleep(0.2)
        assert url, f"server did not start: {server_log.read_text()[-2000:]}"
        run = tmp_path / "run"
        # Output to a file, not a pipe: torch's shared-memory manager, which the CPU tensor
        # wire format starts, inherits the trainer's stdio and lives as long as the server
        # holds a connection to it, so a pipe would not reach EOF when `miles train` exits.
        log = tmp_path / "train.log"
        with log.open("w") as fh:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "miles",
                    "train",
                    "arith-tiny",
                    "--set",
                    f"model_path={tiny_model}",
                    "--set",
                    f"rollout.engine_url={url}",
                    "--set",
                    "rollout.prompts_per_step=4",
                    "--set",
                    "rollout.n_samples_per_prompt=4",
                    "--set",
                    "task.reward_fn=e2e_rewards:response_parity",
                    "--steps",
                    "2",
                    "--out",
                    str(run),
                    "--no-progress",
                ],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=600,
            )
        assert proc.returncode == 0, log.read_text()[-3000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["update/verified"] for r in rows)
        assert all(r["update/bytes"] > 0 for r in rows)
        # The server now serves the trained weights under the last version.
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as resp:
            info = json.loads(resp.read())
        assert info["weight_version"] == "2"
    finally:
        server.terminate()
        server.wait(timeout=30)
