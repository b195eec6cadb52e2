"""miles-env installs alone into a fresh venv (no dependencies), ships its task suite, and its
console script runs a task there."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest
from _env_testlib import needs_local, needs_root

PKG = Path(__file__).resolve().parents[1]

CHECK = """
import sys, miles_env
from miles_env.harbor import builtin_tasks_dir, find_tasks
third_party = sorted(
    m for m in sys.modules
    if m.split(".")[0] not in sys.stdlib_module_names
    and m.split(".")[0] not in ("miles_env", "__main__", "_distutils_hack")  # setuptools' .pth hook
)
assert not third_party, third_party
print(miles_env.__version__, len(find_tasks(builtin_tasks_dir())))
"""


def _run(*cmd: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
@needs_local
@needs_root
def test_install_alone(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    r = _run(py, "-m", "pip", "install", "-q", PKG, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    names = {
        line.split("==")[0].lower()
        for line in _run(py, "-m", "pip", "list", "--format=freeze", cwd=tmp_path).stdout.split()
    }
    assert "miles-env" in names
    assert names <= {"miles-env", "pip", "setuptools", "wheel"}  # no dependencies
    r = _run(py, "-c", CHECK, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[1]) >= 10
    r = _run(env_dir / "bin" / "miles-env", "check", "--policy", "noop", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count('"reward": 0.0') >= 10
    assert sys.version_info >= (3, 11)
