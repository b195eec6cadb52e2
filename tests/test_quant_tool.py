"""tools/quantize_checkpoint.py runs as a program on a real checkpoint (the package's own tests
run `python -m miles_quant.checkpoint_cli`; tools/ is outside their Pants sandbox)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "quantize_checkpoint.py"


def test_quantize_checkpoint_tool_runs(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    cmd = [sys.executable, str(TOOL), str(tiny_model), str(out)]
    run = subprocess.run(
        [*cmd, "-f", "fp8_block128", "--no-progress"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout
    assert json.loads((out / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"
