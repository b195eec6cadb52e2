"""`miles env ...` forwards to miles-env's command line, which is imported only when used."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

from miles import cli


def test_env_forwards_to_miles_env(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("miles_env", reason="miles-env not installed (pip install 'miles[env]')")
    from miles_env.backends.local import local_available
    from miles_env.harbor import builtin_tasks_dir

    ok, why = local_available()
    if not ok:
        pytest.skip(why)
    shutil.copytree(builtin_tasks_dir() / "csv-totals", tmp_path / "csv-totals")
    rc = cli.main(["env", "check", str(tmp_path), "--policy", "noop", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (row["task"], row["reward"], row["error"]) == ("csv-totals", 0.0, False)


def test_env_without_miles_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "miles_env.cli", None)  # as if not installed
    args = cli.build_parser().parse_args(["env", "check"])
    assert isinstance(args, argparse.Namespace)
    with pytest.raises(ImportError, match=r"pip install 'miles\[env\]'"):
        args.fn(args)
