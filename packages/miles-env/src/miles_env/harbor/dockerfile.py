"""The part of a task's Dockerfile the local backend can honour without building an image.

A Harbor task's ``environment/Dockerfile`` usually sets a WORKDIR, copies the task's files in
and sets a few variables. The local backend runs on the host's /usr (no image), so it reads
those instructions and replays them in the sandbox: ``WORKDIR``, ``ENV``, and ``COPY`` /
``ADD`` of files from the build context. Everything else (``FROM``, ``RUN``, ``USER``, ...)
is listed in `DockerfilePlan.ignored`, so a caller can tell the user what was skipped; the
podman backend builds the real image instead.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DockerfilePlan", "parse_dockerfile"]


@dataclass(kw_only=True, slots=True)
class DockerfilePlan:
    """What to replay in a sandbox.

    Attributes:
        workdir: the last WORKDIR (absolute), or None.
        env: variables from ENV, in order.
        copies: (source relative to the build context, absolute destination) per COPY/ADD
            source; a destination ending in "/" is a directory.
        ignored: instructions not replayed, as written (e.g. ``"RUN pip install x"``).
    """

    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def _logical_lines(text: str) -> list[str]:
    lines, cur = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not cur and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            cur += stripped[:-1] + " "
            continue
        lines.append((cur + stripped).strip())
        cur = ""
    if cur.strip():
        lines.append(cur.strip())
    return lines


def parse_dockerfile(path: Path) -> DockerfilePlan:
    """Read a Dockerfile into a `DockerfilePlan`.

    Raises:
        ValueError: a COPY/ADD that names a URL, another stage (``--from``), or a source
            outside the build context; a relative WORKDIR before any absolute one is taken
            from "/".
    """
    plan = DockerfilePlan()
    cwd = "/"
    for line in _logical_lines(path.read_text()):
        op, _, rest = line.partition(" ")
        op = op.upper()
        rest = rest.strip()
        if op == "WORKDIR":
            cwd = posixpath.normpath(posixpath.join(cwd, _expand(rest, plan.env)))
            plan.workdir = cwd
        elif op == "ENV":
            plan.env.update(_parse_env(rest))
        elif op in ("COPY", "ADD"):
            args = _copy_args(rest)
            flags = [a for a in args if a.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                raise ValueError(f"{path}: '{line}' copies from another stage: not supported")
            paths = [a for a in args if not a.startswith("--")]
            if len(paths) < 2:
                raise ValueError(f"{path}: '{line}' needs a source and a destination")
            *sources, dest = paths
            dest = _expand(dest, plan.env)
            absolute = posixpath.normpath(posixpath.join(cwd, dest))
            if dest.endswith("/") or len(sources) > 1:
                absolute += "/"
            for src in sources:
                if "://" in src:
                    raise ValueError(f"{path}: '{line}' fetches a URL: not supported")
                norm = posixpath.normpath(src)
                if norm.startswith("..") or norm.startswith("/"):
                    raise ValueError(f"{path}: '{line}' reads outside the build context")
                plan.copies.append((norm, absolute))
        else:
            if op != "FROM":
                plan.ignored.append(line)
    return plan


def _copy_args(rest: str) -> list[str]:
    if rest.startswith("["):
        return [str(a) for a in json.loads(rest)]
    return shlex.split(rest)


def _parse_env(rest: str) -> dict[str, str]:
    parts = shlex.split(rest)
    if parts and "=" not in parts[0]:  # legacy form: ENV KEY value with spaces
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts)


def _expand(value: str, env: dict[str, str]) -> str:
    for k, v in env.items():
        value = value.replace("${" + k + "}", v).replace("$" + k, v)
    return value
