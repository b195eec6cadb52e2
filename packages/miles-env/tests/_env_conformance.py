"""The conformance checks every sandbox backend must pass (test_conformance.py runs them).

Each check takes an open sandbox and asserts one part of the protocol; they leave the
sandbox usable, so a slow-to-create cloud sandbox serves all of them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_env import ExecResult, Sandbox, SandboxClosedError


async def check_exec_string_and_argv(sb: Sandbox) -> None:
    r = await sb.exec("echo out; echo err >&2; exit 3")
    assert isinstance(r, ExecResult)
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("out\n", "err\n", 3, False)
    r = await sb.exec(["printf", "%s|", "a b", "$HOME", "*"])
    assert r.stdout == "a b|$HOME|*|"  # argv: no shell expansion
    assert r.exit_code == 0
    r = await sb.exec(["/no/such/program"])
    assert r.exit_code != 0  # an error result, not an exception
    assert not r.timed_out


async def check_cwd_and_env(sb: Sandbox) -> None:
    r = await sb.exec("pwd")
    assert r.stdout.strip() == sb.spec.workdir
    await sb.exec("mkdir -p sub/dir")
    r = await sb.exec("pwd", cwd="sub/dir")
    assert r.stdout.strip() == sb.spec.workdir + "/sub/dir"
    r = await sb.exec('printf "%s" "$MILES_A-$MILES_SPEC"', env={"MILES_A": "x y"})
    assert r.stdout == "x y-" + sb.spec.env.get("MILES_SPEC", "")


async def check_timeout_kills_tree(sb: Sandbox) -> None:
    # A child in its own session, and a grandchild daemonized away from it: the timeout
    # must take them all.
    cmd = (
        "setsid sleep 600 & echo $! > /tmp/t_child; "
        "(sleep 600 & echo $! > /tmp/t_grand) & "
        "while :; do :; done"
    )
    r = await sb.exec(cmd, timeout=1.5)
    assert r.timed_out
    assert r.exit_code == 124
    # Running means a /proc entry in a state other than Z (a zombie is dead, waiting for its
    # reaper).
    r = await sb.exec(
        "for f in /tmp/t_child /tmp/t_grand; do "
        's=$(cut -d" " -f3 /proc/$(cat $f)/stat 2>/dev/null); [ -n "$s" ] && [ "$s" != Z ] '
        "&& echo alive; done; echo checked"
    )
    assert r.stdout == "checked\n", r.stdout


async def check_files(sb: Sandbox) -> None:
    blob = bytes(range(256)) * 64 + b"\0end"
    await sb.write_file("data/blob.bin", blob)
    assert await sb.read_file("data/blob.bin") == blob
    assert await sb.read_file(sb.spec.workdir + "/data/blob.bin") == blob
    await sb.write_file("/tmp/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert (await sb.exec("/tmp/run.sh")).stdout == "ran\n"
    await sb.write_file("data/text.txt", "h\u00e9llo\n")
    assert (await sb.exec("cat data/text.txt")).stdout == "h\u00e9llo\n"
    with pytest.raises(FileNotFoundError):
        await sb.read_file("no/such/file")


async def check_dirs(sb: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "top.txt").write_text("top\n")
    (src / "pkg" / "deep" / "leaf.bin").write_bytes(os.urandom(70_000))
    (src / "pkg" / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (src / "pkg" / "tool.sh").chmod(0o755)
    (src / "link").symlink_to("top.txt")
    await sb.upload_dir(src, "up")
    assert (await sb.exec("./up/pkg/tool.sh")).stdout == "tool\n"
    assert (await sb.exec("cat up/link")).stdout == "top\n"
    await sb.exec("echo made-inside > up/new.txt")
    dst = tmp_path / "dst"
    await sb.download_dir("up", dst)
    assert (dst / "pkg" / "deep" / "leaf.bin").read_bytes() == (
        src / "pkg" / "deep" / "leaf.bin"
    ).read_bytes()
    assert (dst / "new.txt").read_text() == "made-inside\n"
    assert os.access(dst / "pkg" / "tool.sh", os.X_OK)
    assert (dst / "link").is_symlink()
    assert (dst / "link").read_text() == "top\n"


async def check_background_persists(sb: Sandbox) -> None:
    r = await sb.exec("nohup sleep 600 >/dev/null 2>&1 & echo $!")
    pid = r.stdout.strip()
    assert pid.isdigit()
    r = await sb.exec(f"kill -0 {pid} && echo running")
    assert r.stdout == "running\n"


async def check_close(sb: Sandbox) -> None:
    assert sb.alive()
    await sb.close()
    assert not sb.alive()
    await sb.close()  # idempotent
    with pytest.raises(SandboxClosedError):
        await sb.exec("true")


CHECKS = [
    check_exec_string_and_argv,
    check_cwd_and_env,
    check_timeout_kills_tree,
    check_files,
    check_background_persists,
]
