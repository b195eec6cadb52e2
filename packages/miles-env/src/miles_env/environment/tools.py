"""The tools an agent calls in a sandbox: a shell, and file tools for coding.

Two tool sets: ``"bash"`` (one tool, ``bash``: terminal tasks) and ``"coding"`` (``bash``,
``read_file``, ``write_file``, ``edit_file``: read and change code without shell quoting).
`run_tool` executes one call and always returns text for the tool message; a call that
cannot be run (unknown tool, bad arguments, a file that is not there) is an error outcome,
never an exception.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from miles_env.environment.protocol import ToolArgumentsError, function_tool, parse_arguments
from miles_env.sandbox import Sandbox

__all__ = ["TOOLSETS", "ToolOutcome", "clip", "run_tool"]

BASH = function_tool(
    "bash",
    "Run a shell command (bash -c) in the task's sandbox and get its exit code, stdout and "
    "stderr. Each call starts a fresh shell in the working directory.",
    {
        "command": {"type": "string", "description": "the command line"},
        "timeout_s": {"type": "number", "description": "seconds before it is killed"},
    },
    ["command"],
)
READ_FILE = function_tool(
    "read_file",
    "Read a text file (relative paths are under the working directory).",
    {"path": {"type": "string"}},
    ["path"],
)
WRITE_FILE = function_tool(
    "write_file",
    "Create or overwrite a file with the given content (parent directories are made).",
    {"path": {"type": "string"}, "content": {"type": "string"}},
    ["path", "content"],
)
EDIT_FILE = function_tool(
    "edit_file",
    "Replace the one exact occurrence of old_text in a file by new_text.",
    {"path": {"type": "string"}, "old_text": {"type": "string"}, "new_text": {"type": "string"}},
    ["path", "old_text", "new_text"],
)
TOOLSETS: dict[str, list[dict[str, Any]]] = {
    "bash": [BASH],
    "coding": [BASH, READ_FILE, WRITE_FILE, EDIT_FILE],
}


@dataclass(kw_only=True, slots=True)
class ToolOutcome:
    """What one tool call did.

    Attributes:
        content: the tool message's text.
        error: the call could not be run (unknown tool, bad arguments, missing file, ...).
        exit_code: ``bash`` only: the command's exit code.
        timed_out: ``bash`` only: the command ran past its timeout and was killed.
        seconds: wall-clock seconds spent in the sandbox.
    """

    content: str
    error: bool = False
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float = 0.0


def clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and its tail."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 5
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


async def run_tool(
    sb: Sandbox,
    call: Mapping[str, Any],
    tools: list[dict[str, Any]],
    *,
    timeout_s: float,
    max_chars: int,
) -> ToolOutcome:
    """Run one OpenAI tool call in ``sb``.

    Args:
        sb: the episode's sandbox.
        call: ``{"id", "type": "function", "function": {"name", "arguments"}}``.
        tools: the tools offered (the call must name one of them).
        timeout_s: the most seconds a ``bash`` command may run (a smaller ``timeout_s``
            argument wins).
        max_chars: tool outputs are clipped to about this many characters.
    """
    name = str((call.get("function") or {}).get("name", ""))
    by_name = {t["function"]["name"]: t for t in tools}
    if name not in by_name:
        return ToolOutcome(
            content=f"error: unknown tool {name!r}; the tools are {', '.join(by_name)}",
            error=True,
        )
    try:
        args = parse_arguments(call, by_name[name])
    except ToolArgumentsError as e:
        return ToolOutcome(content=f"error: {name}: {e}", error=True)
    t0 = time.monotonic()
    if name == "bash":
        out = await _bash(sb, args, timeout_s=timeout_s, max_chars=max_chars)
    else:
        out = await _file_tool(sb, name, args, max_chars=max_chars)
    out.seconds = time.monotonic() - t0
    return out


async def _bash(
    sb: Sandbox, args: dict[str, Any], *, timeout_s: float, max_chars: int
) -> ToolOutcome:
    want = args.get("timeout_s")
    timeout = min(timeout_s, float(want)) if want is not None and want > 0 else timeout_s
    r = await sb.exec(["bash", "-c", args["command"]], timeout=timeout)
    parts = [f"exit code {r.exit_code}" + (f" (killed after {timeout:g} s)" if r.timed_out else "")]
    if r.stdout:
        parts.append(r.stdout.rstrip("\n"))
    if r.stderr:
        parts += ["[stderr]", r.stderr.rstrip("\n")]
    return ToolOutcome(
        content=clip("\n".join(parts), max_chars), exit_code=r.exit_code, timed_out=r.timed_out
    )


async def _file_tool(
    sb: Sandbox, name: str, args: dict[str, Any], *, max_chars: int
) -> ToolOutcome:
    path = args["path"]
    if not path:
        return ToolOutcome(content=f"error: {name}: empty path", error=True)
    try:
        if name == "write_file":
            await sb.write_file(path, args["content"], mode=await _mode_of(sb, path))
            return ToolOutcome(content=f"wrote {len(args['content'].encode())} bytes to {path}")
        data = (await sb.read_file(path)).decode(errors="replace")
        if name == "read_file":
            return ToolOutcome(content=clip(data, max_chars) if data else "(empty file)")
        old, new = args["old_text"], args["new_text"]
        count = data.count(old) if old else 0
        if count != 1:
            why = "old_text is empty" if not old else f"old_text occurs {count} times in {path}"
            return ToolOutcome(
                content=f"error: edit_file: {why}; it must occur exactly once (add context)",
                error=True,
            )
        await sb.write_file(path, data.replace(old, new, 1), mode=await _mode_of(sb, path))
        return ToolOutcome(content=f"edited {path}")
    except OSError as e:  # not there, a directory, read-only, too large: the agent's problem
        return ToolOutcome(content=f"error: {name}: {path}: {e}", error=True)


async def _mode_of(sb: Sandbox, path: str) -> int:
    """The permission bits of an existing file (kept when it is rewritten), else 0o644."""
    r = await sb.exec(["stat", "-c", "%a", "--", sb.resolve(path)])
    text = r.stdout.strip()
    return int(text, 8) if r.exit_code == 0 and text.isdigit() else 0o644
