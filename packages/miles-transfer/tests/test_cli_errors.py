"""``miles-transfer``'s one error path (issue 31): a delta manifest of the wrong shape (a null
chunk index first) and a public p2p-agent without a key print one line naming the file, the
field and the fix, exit 2 and change nothing; ``--debug`` shows the traceback."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from delta_testutil import base_tensors, snapshot, step, write_checkpoint

from miles_transfer.cli import main

pytest.importorskip("xxhash")


@pytest.fixture
def delta(tmp_path: Path) -> tuple[Path, Path]:
    """(a target checkpoint, a delta that applies to it with changed chunks)."""
    base = write_checkpoint(tmp_path / "base", base_tensors())
    new = write_checkpoint(tmp_path / "new", step(base_tensors(), 0.02, seed=1))
    d = tmp_path / "d"
    assert main(["delta", "encode", "--base", str(base), "--new", str(new), "--out", str(d)]) == 0
    return base, d


def _patched(m: dict[str, Any]) -> dict[str, Any]:
    """A tensor entry with chunks (what the edits below damage)."""
    return next(t for t in m["tensors"].values() if t["chunks"])


def _chunk(i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        _patched(m)["chunks"][0][i] = value

    return edit


def _field(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        _patched(m)[key] = value

    return edit


def _top(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m[key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_chunk(0, None), "chunk index must be an integer in [0, "),
        (_chunk(0, 10**9), "chunk index must be an integer in [0, "),
        (_chunk(1, "rle"), "layout 'rle'"),
        (_chunk(2, -1), "changed must be an integer >= 0, got -1"),
        (_chunk(3, [0, 10**12, 0, "x"]), "lie beyond the payload"),
        (_chunk(3, None), "ref must be [offset, size, raw_size, checksum], got null"),
        (_field("chunk_elems", 0), "chunk_elems must be an integer > 0, got 0"),
        (_field("shape", [None]), "shape must be a list of integers >= 0, got [null]"),
        (_top("payload_size", "big"), "payload_size must be an integer >= 0"),
        (_top("other_files", []), "other_files must be an object"),
    ],
)
def test_a_manifest_of_the_wrong_shape_is_one_line(
    delta: tuple[Path, Path], edit: Any, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target, d = delta
    manifest = json.loads((d / "delta.json").read_text())
    edit(manifest)
    (d / "delta.json").write_text(json.dumps(manifest))
    before = snapshot(target)
    capsys.readouterr()
    for command in ("apply", "verify"):
        assert main(["delta", command, "--target", str(target), "--delta", str(d)]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err
        assert lines[0].startswith(f"miles-transfer delta {command}: error: {d / 'delta.json'}")
        assert "malformed delta manifest" in lines[0]
        assert message in lines[0]
    assert snapshot(target) == before  # nothing applied
    with pytest.raises(ValueError, match="malformed delta manifest"):
        main(["--debug", "delta", "apply", "--target", str(target), "--delta", str(d)])


def test_public_p2p_agent_without_a_key(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["p2p-agent", "--engine-url", "http://127.0.0.1:1", "--host", "0.0.0.0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("miles-transfer p2p-agent: error: the p2p-agent would listen on 0.0.0.0")
    assert "--insecure-no-auth" in err


def test_a_copy_of_the_checkpoint_is_untouched_by_a_truncated_payload(
    delta: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, d = delta
    work = Path(shutil.copytree(target, tmp_path / "work"))
    payload = d / "delta.bin"
    payload.write_bytes(payload.read_bytes()[:-10])
    before = snapshot(work)
    assert main(["delta", "apply", "--target", str(work), "--delta", str(d)]) == 2
    assert "truncated" in capsys.readouterr().err
    assert snapshot(work) == before
