"""What the cloud adapters share: lazy SDK import, key checks, the SDK surface each one
calls (pinned by test_cloud_surface.py), and a framing of commands for SDKs whose exec
returns stdout and stderr mixed, or takes no cwd / env / timeout."""

from __future__ import annotations

import base64
import importlib
import importlib.util
import os
import shlex
import uuid
from collections.abc import Mapping, Sequence
from types import ModuleType

__all__ = ["framed_script", "key_status", "parse_framed", "require_sdk"]


def require_sdk(module: str, extra: str) -> ModuleType:
    """Import a cloud SDK, or fail naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the {extra} sandbox backend needs its SDK ({module}): "
            f"pip install 'miles-env[{extra}]'"
        ) from e


def key_status(module: str, extra: str, keys: Sequence[str]) -> tuple[bool, str]:
    """(usable, why not): the SDK importable and every key variable set (a cloud backend's
    conformance tests run only then, and are reported as skipped otherwise)."""
    if importlib.util.find_spec(module) is None:
        return False, f"SDK not installed: pip install 'miles-env[{extra}]'"
    missing = [k for k in keys if not os.environ.get(k)]
    if missing:
        return False, f"{' and '.join(missing)} not set (needs an account with {extra} and network)"
    return True, ""


def shell_command(argv: Sequence[str]) -> str:
    """A command string for SDKs that take one: argv ``["sh", "-c", s]`` stays ``s``'s
    meaning, other argv are quoted."""
    return shlex.join(argv)


def framed_script(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    timeout: float | None,
) -> tuple[str, str]:
    """A ``sh`` script running ``argv`` in ``cwd`` with ``env`` and a timeout that kills its
    process group, that prints its stdout and stderr base64-framed after a random marker.

    Returns:
        (script, marker) for `parse_framed`.
    """
    marker = "MILES-ENV-" + uuid.uuid4().hex
    run = shell_command(argv)
    if env:
        run = "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " " + run
    if timeout is not None:
        # timeout(1) runs the command in its own process group and signals the group;
        # 124 is its status when the time ran out.
        run = f"timeout -k 2 {timeout:.3f} {run}"
    script = (
        f'o=$(mktemp) e=$(mktemp); cd -- {shlex.quote(cwd)} 2>"$e" && {{ {run} ; }} '
        '</dev/null >"$o" 2>>"$e"; rc=$?; '
        f'printf "\\n{marker} %s\\n" "$rc"; base64 -w0 "$o"; printf "\\n{marker}\\n"; '
        f'base64 -w0 "$e"; printf "\\n{marker}\\n"; rm -f "$o" "$e"'
    )
    return script, marker


def parse_framed(output: str, marker: str) -> tuple[str, str, int] | None:
    """(stdout, stderr, exit code) from a framed script's output; None if not framed."""
    head, sep, rest = output.partition(f"\n{marker} ")
    if not sep:
        return None
    rc_text, _, rest = rest.partition("\n")
    parts = rest.split(f"\n{marker}\n")
    if len(parts) < 2 or not rc_text.strip().lstrip("-").isdigit():
        return None
    out = base64.b64decode(parts[0].strip() or b"").decode("utf-8", "replace")
    err = base64.b64decode(parts[1].strip() or b"").decode("utf-8", "replace")
    _ = head  # anything printed before the frame (shell noise) is dropped
    return out, err, int(rc_text)


def b64_write_commands(path: str, data: bytes, *, chunk: int = 48 * 1024) -> list[str]:
    """Shell commands writing ``data`` to ``path`` in base64 chunks (for SDKs with no file
    upload that takes bytes)."""
    q = shlex.quote(path)
    cmds = [f'mkdir -p -- "$(dirname -- {q})" && : > {q}']
    for i in range(0, len(data), chunk):
        piece = base64.b64encode(data[i : i + chunk]).decode()
        cmds.append(f"printf %s {piece} | base64 -d >> {q}")
    return cmds
