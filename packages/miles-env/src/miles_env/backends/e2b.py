"""E2B adapter: a thin layer over the ``e2b`` SDK (``pip install 'miles-env[e2b]'``, key in
``E2B_API_KEY``).

Spec mapping: image -> the E2B template (None: E2B's default), env -> ``envs``, network
"none" -> ``allow_internet_access=False``, an allowlist -> ``network={"allow_out": [...]}``,
ttl_s -> the sandbox ``timeout`` (E2B kills it then, also if this process dies). cpus,
memory_mb, disk_mb and pids are fixed by the template. Commands that exit non-zero come back
from the SDK as ``CommandExitException``: turned into an `ExecResult` here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from miles_env.backends._cloud import key_status, require_sdk, shell_command
from miles_env.sandbox import Command, Sandbox, argv_of, check_env
from miles_env.spec import ExecResult, SandboxSpec

__all__ = ["SDK_SURFACE", "E2BSandbox", "available"]

SDK_SURFACE: list[tuple[str, tuple[str, ...]]] = [
    (
        "e2b:AsyncSandbox.create",
        ("template", "timeout", "metadata", "envs", "allow_internet_access", "network"),
    ),
    ("e2b:AsyncSandbox.kill", ()),
    ("e2b:Sandbox.kill", ()),
    ("e2b:Sandbox._cls_kill", ("sandbox_id",)),  # Sandbox.kill(sandbox_id) on the class
    (
        "e2b.sandbox_async.commands.command:Commands.run",
        ("cmd", "envs", "user", "cwd", "timeout"),
    ),
    ("e2b.sandbox_async.filesystem.filesystem:Filesystem.read", ("path", "format")),
    ("e2b.sandbox_async.filesystem.filesystem:Filesystem.write", ("path", "data")),
    ("e2b:CommandExitException", ("stderr", "stdout", "exit_code", "error")),
    ("e2b:TimeoutException", ()),
    ("e2b:CommandResult", ("stdout", "stderr", "exit_code")),
]


def available() -> tuple[bool, str]:
    """(usable, why not): the SDK installed and E2B_API_KEY set."""
    return key_status("e2b", "e2b", ["E2B_API_KEY"])


class E2BSandbox(Sandbox):
    """An E2B sandbox."""

    backend = "e2b"

    def __init__(self, spec: SandboxSpec, sandbox: Any) -> None:
        super().__init__(spec, str(sandbox.sandbox_id))
        self._sb = sandbox
        self._deadline = time.monotonic() + spec.ttl_s

    @classmethod
    async def create(cls, spec: SandboxSpec) -> E2BSandbox:
        """Create an E2B sandbox from ``spec.image`` as the template name."""
        if spec.rootfs is not None:
            raise ValueError("the e2b backend runs templates, not a rootfs: set spec.image")
        e2b = require_sdk("e2b", "e2b")
        kwargs: dict[str, Any] = {}
        if spec.allowlist:
            kwargs["network"] = {"allow_out": list(spec.allowlist)}
        sandbox = await e2b.AsyncSandbox.create(
            template=spec.image,
            timeout=int(spec.ttl_s),
            metadata={"miles-env.owner": str(os.getpid())},
            envs=dict(spec.env),
            allow_internet_access=spec.network != "none",
            **kwargs,
        )
        sb = cls(spec, sandbox)
        await sb.exec(["mkdir", "-p", spec.workdir])
        return sb

    def alive(self) -> bool:
        return not self._closed and time.monotonic() < self._deadline

    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> ExecResult:
        self._check_open()
        e2b = require_sdk("e2b", "e2b")
        argv = argv_of(cmd)
        start = time.monotonic()
        timed_out = False
        try:
            r = await self._sb.commands.run(
                shell_command(argv),
                envs=check_env(env),
                user=user,
                cwd=self.resolve(cwd) if cwd else self.spec.workdir,
                timeout=timeout if timeout is not None else 0,  # 0: no limit
            )
            out, err, rc = r.stdout, r.stderr, r.exit_code
        except e2b.CommandExitException as e:
            out, err, rc = e.stdout, e.stderr, e.exit_code
        except e2b.TimeoutException as e:
            out, err, rc, timed_out = "", str(e), 124, True
        return ExecResult(
            stdout=out or "",
            stderr=err or "",
            exit_code=int(rc),
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
        )

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        p = self.resolve(path)
        try:
            data = await self._sb.files.read(p, format="bytes")
        except Exception as e:
            raise FileNotFoundError(f"{p}: {e}") from e
        return bytes(data)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        self._check_open()
        p = self.resolve(path)
        await self._sb.files.write(p, data)
        await self.exec(["chmod", f"{mode:o}", p])

    async def _close(self) -> None:
        await self._sb.kill()

    def _close_sync(self) -> None:
        e2b = require_sdk("e2b", "e2b")
        e2b.Sandbox.kill(self.id)
