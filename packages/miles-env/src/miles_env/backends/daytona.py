"""Daytona adapter: a thin layer over the ``daytona`` SDK (``pip install 'miles-env[daytona]'``,
key in ``DAYTONA_API_KEY``).

Spec mapping: image -> ``CreateSandboxFromImageParams.image`` (default python:3.12-slim),
cpus / memory_mb / disk_mb -> ``Resources`` (rounded up to whole cores / GiB), network "none"
-> ``network_block_all``, an allowlist -> ``network_allow_list`` (CIDRs), ttl_s ->
``ttl_minutes`` (the provider destroys it even if this process dies) with
``ephemeral=True`` (deleted when stopped). Daytona's exec returns one output stream: commands
run framed (`_cloud.framed_script`) to keep stdout and stderr apart.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import Any

from miles_env.backends._cloud import framed_script, key_status, parse_framed, require_sdk
from miles_env.sandbox import Command, Sandbox, argv_of, check_env
from miles_env.spec import ExecResult, SandboxSpec

__all__ = ["SDK_SURFACE", "DaytonaSandbox", "available"]

DEFAULT_IMAGE = "python:3.12-slim"
# (callable, parameters this adapter passes): test_cloud_surface.py checks them against the
# installed SDK.
SDK_SURFACE: list[tuple[str, tuple[str, ...]]] = [
    ("daytona:AsyncDaytona", ("config",)),
    ("daytona:AsyncDaytona.create", ("params", "timeout")),
    ("daytona:AsyncDaytona.close", ()),
    ("daytona:DaytonaConfig", ("api_key",)),
    (
        "daytona:CreateSandboxFromImageParams",
        (
            "image",
            "env_vars",
            "labels",
            "resources",
            "network_block_all",
            "network_allow_list",
            "ttl_minutes",
            "ephemeral",
            "auto_stop_interval",
        ),
    ),
    ("daytona:Resources", ("cpu", "memory", "disk")),
    ("daytona._async.process:AsyncProcess.exec", ("command", "cwd", "env", "timeout")),
    ("daytona._async.filesystem:AsyncFileSystem.upload_file", ("src", "dst")),
    ("daytona._async.filesystem:AsyncFileSystem.download_file", ()),
    ("daytona._async.sandbox:AsyncSandbox.delete", ("timeout",)),
    ("daytona:Daytona.get", ("sandbox_id_or_name",)),
    ("daytona._sync.sandbox:Sandbox.delete", ("timeout",)),
    ("daytona.common.process:ExecuteResponse", ("exit_code", "result")),
]


def available() -> tuple[bool, str]:
    """(usable, why not): the SDK installed and DAYTONA_API_KEY set."""
    return key_status("daytona", "daytona", ["DAYTONA_API_KEY"])


class DaytonaSandbox(Sandbox):
    """A Daytona sandbox."""

    backend = "daytona"

    def __init__(self, spec: SandboxSpec, client: Any, sandbox: Any) -> None:
        super().__init__(spec, str(sandbox.id))
        self._client = client
        self._sb = sandbox
        self._deadline = time.monotonic() + spec.ttl_s

    @classmethod
    async def create(
        cls, spec: SandboxSpec, *, api_key: str | None = None, create_timeout_s: float = 300
    ) -> DaytonaSandbox:
        """Create a Daytona sandbox (``api_key`` default: DAYTONA_API_KEY)."""
        if spec.rootfs is not None:
            raise ValueError("the daytona backend runs images, not a rootfs: set spec.image")
        dt = require_sdk("daytona", "daytona")
        client = dt.AsyncDaytona(dt.DaytonaConfig(api_key=api_key) if api_key else None)
        params = dt.CreateSandboxFromImageParams(
            image=spec.image or DEFAULT_IMAGE,
            env_vars=dict(spec.env),
            labels={"miles-env.owner": str(os.getpid())},
            resources=dt.Resources(
                cpu=math.ceil(spec.cpus),
                memory=math.ceil(spec.memory_mb / 1024),
                disk=math.ceil(spec.disk_mb / 1024),
            ),
            network_block_all=spec.network == "none",
            network_allow_list=",".join(spec.allowlist) if spec.allowlist else None,
            ttl_minutes=max(1, math.ceil(spec.ttl_s / 60)),
            ephemeral=True,
            auto_stop_interval=max(1, math.ceil(spec.ttl_s / 60)),
        )
        try:
            sandbox = await client.create(params, timeout=create_timeout_s)
        except BaseException:
            await client.close()
            raise
        sb = cls(spec, client, sandbox)
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
        if user is not None:
            raise ValueError("the daytona backend runs commands as the sandbox's os_user only")
        argv = argv_of(cmd)
        wd = self.resolve(cwd) if cwd else self.spec.workdir
        script, marker = framed_script(argv, cwd=wd, env=check_env(env), timeout=timeout)
        start = time.monotonic()
        resp = await self._sb.process.exec(script, timeout=None)
        parsed = parse_framed(str(resp.result or ""), marker)
        if parsed is None:
            out, err, rc = str(resp.result or ""), "", int(resp.exit_code)
        else:
            out, err, rc = parsed
        return ExecResult(
            stdout=out,
            stderr=err,
            exit_code=rc,
            timed_out=timeout is not None and rc == 124,
            duration_s=time.monotonic() - start,
        )

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        p = self.resolve(path)
        try:
            data = await self._sb.fs.download_file(p)
        except Exception as e:
            raise FileNotFoundError(f"{p}: {e}") from e
        if data is None:
            raise FileNotFoundError(p)
        return bytes(data)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        self._check_open()
        p = self.resolve(path)
        await self.exec(["mkdir", "-p", os.path.dirname(p)])
        await self._sb.fs.upload_file(data.encode() if isinstance(data, str) else data, p)
        await self.exec(["chmod", f"{mode:o}", p])

    async def _close(self) -> None:
        try:
            await self._sb.delete(timeout=120)
        finally:
            await self._client.close()

    def _close_sync(self) -> None:
        dt = require_sdk("daytona", "daytona")
        dt.Daytona().get(sandbox_id_or_name=self.id).delete(timeout=120)
