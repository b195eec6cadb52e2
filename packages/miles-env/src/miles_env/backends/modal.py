"""Modal adapter: a thin layer over the ``modal`` SDK (``pip install 'miles-env[modal]'``,
token in ``MODAL_TOKEN_ID`` / ``MODAL_TOKEN_SECRET``).

Spec mapping: image -> ``Image.from_registry`` (None: ``Image.debian_slim()``), env, workdir,
cpus -> ``cpu``, memory_mb -> ``memory``, network "none" -> ``block_network``, an allowlist
-> ``cidr_allowlist``, ttl_s -> the sandbox ``timeout`` (Modal terminates it then, also if
this process dies). The sandbox runs ``sleep infinity``; each exec is a Modal exec.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from miles_env.backends._cloud import key_status, require_sdk
from miles_env.sandbox import Command, Sandbox, argv_of, check_env
from miles_env.spec import ExecResult, SandboxSpec

__all__ = ["APP_NAME", "SDK_AIO", "SDK_SURFACE", "ModalSandbox", "available"]

APP_NAME = "miles-env"
SDK_SURFACE: list[tuple[str, tuple[str, ...]]] = [
    ("modal:App.lookup", ("name", "create_if_missing")),
    ("modal:Image.from_registry", ("tag",)),
    ("modal:Image.debian_slim", ()),
    (
        "modal:Sandbox.create",
        (
            "app",
            "image",
            "env",
            "timeout",
            "workdir",
            "cpu",
            "memory",
            "block_network",
            "cidr_allowlist",
        ),
    ),
    ("modal:Sandbox.exec", ("timeout", "workdir", "env")),
    ("modal:Sandbox.terminate", ()),
    ("modal:Sandbox.from_id", ("sandbox_id",)),
    ("modal:Sandbox.poll", ()),
    ("modal.sandbox._filesystem:_SandboxFilesystem.read_bytes", ("remote_path",)),
    ("modal.sandbox._filesystem:_SandboxFilesystem.write_bytes", ("data", "remote_path")),
    ("modal.container_process:ContainerProcess.wait", ()),
]
# Called through their ``.aio`` async variant (synchronicity wrappers).
SDK_AIO: list[str] = [
    "modal:App.lookup",
    "modal:Sandbox.create",
    "modal:Sandbox.exec",
    "modal:Sandbox.terminate",
    "modal.sandbox.sandbox:SandboxFilesystem.read_bytes",
    "modal.sandbox.sandbox:SandboxFilesystem.write_bytes",
    "modal.io_streams:StreamReader.read",
    "modal.container_process:ContainerProcess.wait",
]


def available() -> tuple[bool, str]:
    """(usable, why not): the SDK installed and a Modal token set."""
    return key_status("modal", "modal", ["MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"])


class ModalSandbox(Sandbox):
    """A Modal sandbox."""

    backend = "modal"

    def __init__(self, spec: SandboxSpec, sandbox: Any) -> None:
        super().__init__(spec, str(sandbox.object_id))
        self._sb = sandbox
        self._deadline = time.monotonic() + spec.ttl_s

    @classmethod
    async def create(cls, spec: SandboxSpec, *, app_name: str = APP_NAME) -> ModalSandbox:
        """Create a Modal sandbox in app ``app_name`` (made if missing)."""
        if spec.rootfs is not None:
            raise ValueError("the modal backend runs images, not a rootfs: set spec.image")
        modal = require_sdk("modal", "modal")
        app = await modal.App.lookup.aio(app_name, create_if_missing=True)
        image = modal.Image.from_registry(spec.image) if spec.image else modal.Image.debian_slim()
        sandbox = await modal.Sandbox.create.aio(
            "sleep",
            "infinity",
            app=app,
            image=image,
            env=dict(spec.env),
            timeout=int(spec.ttl_s),
            workdir=spec.workdir,
            cpu=spec.cpus,
            memory=spec.memory_mb,
            block_network=spec.network == "none",
            cidr_allowlist=list(spec.allowlist) if spec.allowlist else None,
        )
        return cls(spec, sandbox)

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
            raise ValueError("the modal backend runs commands as the image's user only")
        argv = argv_of(cmd)
        start = time.monotonic()
        proc = await self._sb.exec.aio(
            *argv,
            timeout=None if timeout is None else max(1, int(timeout + 0.999)),
            workdir=self.resolve(cwd) if cwd else self.spec.workdir,
            env=check_env(env) or None,
        )
        out = await proc.stdout.read.aio()
        err = await proc.stderr.read.aio()
        rc = await proc.wait.aio()
        elapsed = time.monotonic() - start
        timed_out = timeout is not None and rc != 0 and elapsed >= timeout
        return ExecResult(
            stdout=out,
            stderr=err,
            exit_code=124 if timed_out else int(rc),
            timed_out=timed_out,
            duration_s=elapsed,
        )

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        p = self.resolve(path)
        try:
            return bytes(await self._sb.filesystem.read_bytes.aio(p))
        except Exception as e:
            raise FileNotFoundError(f"{p}: {e}") from e

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        self._check_open()
        p = self.resolve(path)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        await self.exec(["mkdir", "-p", p.rsplit("/", 1)[0] or "/"])
        await self._sb.filesystem.write_bytes.aio(payload, p)
        await self.exec(["chmod", f"{mode:o}", p])

    async def _close(self) -> None:
        await self._sb.terminate.aio()

    def _close_sync(self) -> None:
        modal = require_sdk("modal", "modal")
        modal.Sandbox.from_id(self.id).terminate()
