"""AgentEnv adapter: a thin layer over the ``agv`` SDK (module ``agentenv``;
``pip install 'miles-env[agentenv]'``, key in ``AGENTENV_API_KEY``).

The SDK is synchronous (calls run in a worker thread) and its exec takes one command string
and returns mixed output: commands run framed (`_cloud.framed_script`), files move as base64
through exec. Spec mapping: image, cpus -> ``cpu`` (millicores), memory_mb -> ``memory``,
env, ttl_s -> ``max_lifetime_seconds``. AgentEnv has no network switch: only
``network="public"`` is accepted.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shlex
import time
from collections.abc import Mapping
from typing import Any

from miles_env.backends._cloud import (
    b64_write_commands,
    framed_script,
    key_status,
    parse_framed,
    require_sdk,
)
from miles_env.sandbox import Command, Sandbox, argv_of, check_env
from miles_env.spec import ExecResult, SandboxSpec

__all__ = ["SDK_SURFACE", "AgentEnvSandbox", "available"]

DEFAULT_IMAGE = "python:3.12-slim"
SDK_SURFACE: list[tuple[str, tuple[str, ...]]] = [
    ("agentenv:Client", ("api_key",)),
    (
        "agentenv.sdk:SandboxAPI.create",
        ("image", "cpu", "memory", "max_lifetime_seconds", "args", "env"),
    ),
    ("agentenv.sdk:SandboxAPI.get", ("sandbox_id",)),
    (
        "agentenv.api.sandbox:SandboxAPI.wait_for_status",
        ("sandbox_id", "desired_status", "timeout"),
    ),
    ("agentenv:SandboxResource.exec", ("command",)),
    ("agentenv:SandboxResource.delete", ()),
    ("agentenv.api.models:SandboxExecResult", ("output", "exit_code")),
]


def available() -> tuple[bool, str]:
    """(usable, why not): the SDK installed and AGENTENV_API_KEY set."""
    return key_status("agentenv", "agentenv", ["AGENTENV_API_KEY"])


class AgentEnvSandbox(Sandbox):
    """An AgentEnv sandbox."""

    backend = "agentenv"

    def __init__(self, spec: SandboxSpec, client: Any, resource: Any) -> None:
        super().__init__(spec, str(resource.id))
        self._client = client
        self._res = resource
        self._deadline = time.monotonic() + spec.ttl_s

    @classmethod
    async def create(
        cls, spec: SandboxSpec, *, api_key: str | None = None, start_timeout_s: float = 300
    ) -> AgentEnvSandbox:
        """Create an AgentEnv sandbox (``api_key`` default: AGENTENV_API_KEY)."""
        if spec.rootfs is not None:
            raise ValueError("the agentenv backend runs images, not a rootfs: set spec.image")
        if spec.network != "public":
            raise ValueError(
                "the agentenv backend cannot restrict the network: set network='public' "
                "(or use local, podman, daytona, e2b or modal)"
            )
        agv = require_sdk("agentenv", "agentenv")
        from agentenv.api.sandbox import SandboxAPI as RawSandboxAPI

        def make() -> tuple[Any, Any]:
            client = agv.Client(api_key=api_key)
            res = client.sandbox.create(
                image=spec.image or DEFAULT_IMAGE,
                cpu=max(100, int(spec.cpus * 1000)),
                memory=spec.memory_mb,
                max_lifetime_seconds=int(spec.ttl_s),
                args=["sleep", "infinity"],
                env={**spec.env, "MILES_ENV_OWNER": str(os.getpid())},
            )
            RawSandboxAPI(client._client).wait_for_status(
                sandbox_id=res.id, desired_status="running", timeout=start_timeout_s
            )
            return client, client.sandbox.get(sandbox_id=res.id)

        client, res = await asyncio.to_thread(make)
        sb = cls(spec, client, res)
        await sb.exec(["mkdir", "-p", spec.workdir], cwd="/")
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
            raise ValueError("the agentenv backend runs commands as the image's user only")
        wd = self.resolve(cwd) if cwd else self.spec.workdir
        script, marker = framed_script(argv_of(cmd), cwd=wd, env=check_env(env), timeout=timeout)
        start = time.monotonic()
        r = await asyncio.to_thread(self._res.exec, "sh -c " + shlex.quote(script))
        parsed = parse_framed(r.output, marker)
        out, err, rc = parsed if parsed is not None else (r.output, "", int(r.exit_code))
        return ExecResult(
            stdout=out,
            stderr=err,
            exit_code=rc,
            timed_out=timeout is not None and rc == 124,
            duration_s=time.monotonic() - start,
        )

    async def read_file(self, path: str) -> bytes:
        p = self.resolve(path)
        r = await self.exec(["base64", "-w0", p], cwd="/")
        if r.exit_code != 0:
            raise FileNotFoundError(f"{p}: {r.stderr.strip()}")
        return base64.b64decode(r.stdout.strip())

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        p = self.resolve(path)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        for cmd in [*b64_write_commands(p, payload), f"chmod {mode:o} {shlex.quote(p)}"]:
            r = await self.exec(cmd, cwd="/")
            if r.exit_code != 0:
                raise OSError(f"write_file {p} failed: {r.stderr.strip()}")

    async def _close(self) -> None:
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        try:
            self._res.delete()
        finally:
            self._client.close()
