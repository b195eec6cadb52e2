"""``miles-rollout``'s one error path: a mistake prints one line naming the problem and the fix
and exits 2; ``--debug`` shows the traceback instead (issue 31)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from miles_rollout.cli import main


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def damaged(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("damaged")
    out = {}
    for name in ("config", "weights", "truncated"):
        d = root / name
        shutil.copytree(model_dir, d)
        out[name] = d
    (out["config"] / "config.json").write_text('{"model_type": "qwen3", ')
    st = out["weights"] / "model.safetensors"
    st.write_bytes(b"\xff" * 64)
    st = out["truncated"] / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    return out


def test_serve_on_a_busy_port(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "--model-path", str(model_dir), "--port", str(port)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"127.0.0.1:{port} is already in use" in line
    assert "--port" in line


@pytest.mark.parametrize(
    ("which", "expected"),
    [
        ("config", "config.json is not valid JSON"),
        ("weights", "model.safetensors is not a readable safetensors file"),
        ("truncated", "model.safetensors is not a readable safetensors file"),
    ],
)
def test_serve_on_a_damaged_checkpoint(
    damaged: dict[str, Path], which: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model-path", str(damaged[which]), "--port", "0"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("miles-rollout serve: error: ")
    assert expected in line
    assert "save_pretrained" in line  # the fix


def test_debug_shows_the_traceback(damaged: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        main(["serve", "--model-path", str(damaged["config"]), "--port", "0", "--debug"])
    with pytest.raises(ValueError, match="not valid JSON"):
        main(["--debug", "serve", "--model-path", str(damaged["config"]), "--port", "0"])


def test_public_address_without_a_key(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Refused before anything binds or loads.
    argv = ["serve", "--model-path", str(model_dir), "--host", "0.0.0.0", "--port", "0"]
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--api-key" in line
    assert "--insecure-no-auth" in line
    assert main(["sessions", "--engine-url", "http://127.0.0.1:1", "--model-path", str(model_dir),
                 "--host", "0.0.0.0"]) == 2  # fmt: skip
    assert "--insecure-no-auth" in _one_line(capsys.readouterr().err)


def test_sessions_on_a_busy_port(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from chat_fixtures import with_chat_template

    chat = with_chat_template(model_dir, model_dir.parent / "chat-for-cli-errors")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        argv = ["sessions", "--engine-url", "http://127.0.0.1:1", "--model-path", str(chat)]
        assert main([*argv, "--port", str(port)]) == 2
    assert "is already in use" in _one_line(capsys.readouterr().err)
