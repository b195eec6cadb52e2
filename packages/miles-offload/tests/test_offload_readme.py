"""The README's usage example runs as written (its NVMe directory moved under a temporary one)
and saves torch AdamW's state format."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE_PATH = "/local_nvme/optim/rank0"


def test_readme_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    assert EXAMPLE_PATH in blocks[0]
    code = blocks[0].replace(EXAMPLE_PATH, str(tmp_path / "nvme"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "nvme" / "manifest.json").exists()
    saved = torch.load(tmp_path / "optim.pt")
    assert sorted(saved["state"]) == [0, 1]
    assert float(saved["state"][0]["step"]) == 1
    assert saved["state"][0]["exp_avg"].shape == (4096, 4096)
    assert saved["param_groups"][0]["lr"] == 1e-5
