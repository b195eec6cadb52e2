"""``miles-transfer delta encode|apply|verify``: exit codes, messages, progress, atomicity."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from delta_testutil import base_tensors, same_files, snapshot, step, write_checkpoint

from miles_transfer.cli import main

pytest.importorskip("xxhash")


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    base = base_tensors()
    b = write_checkpoint(tmp_path / "base", base)
    n = write_checkpoint(tmp_path / "new", step(base, 0.02, seed=1))
    return b, n


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_encode_verify_apply(dirs, tmp_path, capsys, encoding):
    base, new = dirs
    d = tmp_path / "d"
    args = ["--base", str(base), "--new", str(new), "--out", str(d), "--encoding", encoding]
    assert main(["delta", "encode", *args]) == 0
    out, err = capsys.readouterr()
    assert f"{encoding} delta:" in out
    assert "elements changed" in out
    assert "encode:" in err
    assert "GB/s" in err
    assert main(["delta", "verify", "--target", str(base), "--delta", str(d)]) == 0
    assert "applies to" in capsys.readouterr().out
    target = Path(shutil.copytree(base, tmp_path / "t"))
    assert main(["delta", "apply", "--target", str(target), "--delta", str(d), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "every checksum verified" in out
    assert err == ""
    assert same_files(target, new)
    assert main(["delta", "verify", "--target", str(target), "--delta", str(d)]) == 0
    assert "already holds" in capsys.readouterr().out
    assert main(["compare", str(target), str(new)]) == 0


def test_mismatch_exits_1_and_bad_input_exits_2_leaving_the_target_unchanged(
    dirs, tmp_path, capsys
):
    base, new = dirs
    d = tmp_path / "d"
    assert main(["delta", "encode", "--base", str(base), "--new", str(new), "--out", str(d)]) == 0
    other = write_checkpoint(tmp_path / "other", step(base_tensors(), 0.01, seed=5))
    before = snapshot(other)
    capsys.readouterr()
    assert main(["delta", "apply", "--target", str(other), "--delta", str(d)]) == 1
    assert "mismatch" in capsys.readouterr().err
    assert snapshot(other) == before
    payload = d / "delta.bin"
    payload.write_bytes(payload.read_bytes()[:-1])
    assert main(["delta", "apply", "--target", str(base), "--delta", str(d)]) == 2
    assert "truncated" in capsys.readouterr().err
    assert main(["delta", "verify", "--target", str(base), "--delta", str(tmp_path)]) == 2
    assert "not a delta directory" in capsys.readouterr().err


def test_console_script_runs_as_a_process(dirs, tmp_path):
    base, new = dirs
    cmd = [sys.executable, "-m", "miles_transfer.cli", "delta", "encode", "--base", str(base)]
    proc = subprocess.run(
        [*cmd, "--new", str(new), "--out", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
