"""The sandbox protocol every backend implements, and `create_sandbox`.

A sandbox is created, runs commands, moves files, and is closed exactly once. Closing is
guaranteed: by ``async with``, by ``close()``, and for sandboxes still open when the
interpreter exits, by an ``atexit`` hook (the local backend's processes also die with their
parent when the interpreter is killed outright; cloud sandboxes carry the spec's ``ttl_s`` as
the provider's own deadline).
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import importlib
import logging
import posixpath
import shlex
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from miles_env._files import pack_dir, unpack_tar
from miles_env.spec import ExecResult, SandboxSpec

__all__ = ["BACKENDS", "Sandbox", "SandboxClosedError", "create_sandbox", "open_sandboxes"]

log = logging.getLogger(__name__)

# Backend name -> "module:class"; each class has `async create(spec, **options)`.
BACKENDS: dict[str, str] = {
    "local": "miles_env.backends.local:LocalSandbox",
    "podman": "miles_env.backends.podman:PodmanSandbox",
    "daytona": "miles_env.backends.daytona:DaytonaSandbox",
    "e2b": "miles_env.backends.e2b:E2BSandbox",
    "modal": "miles_env.backends.modal:ModalSandbox",
    "agentenv": "miles_env.backends.agentenv:AgentEnvSandbox",
}

Command = str | Sequence[str]


class SandboxClosedError(RuntimeError):
    """The sandbox was closed, or died (its ttl_s ran out), before this call."""


class Sandbox(abc.ABC):
    """One isolated place to run commands. Use as ``async with await create_sandbox(...)``.

    Attributes:
        id: the backend's identifier of this sandbox.
        spec: the spec it was created from.
        backend: the backend's name (``"local"``, ``"podman"``, ...).
    """

    backend: ClassVar[str] = ""

    def __init__(self, spec: SandboxSpec, sandbox_id: str) -> None:
        self.spec = spec
        self.id = sandbox_id
        self._closed = False
        _OPEN.add(self)

    # -- the protocol ------------------------------------------------------------------------

    @abc.abstractmethod
    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run a command and wait for it.

        Args:
            cmd: a string, run by ``sh -c``, or an argv list, run as is.
            cwd: working directory inside the sandbox (default: the spec's workdir).
            env: extra environment variables for this command.
            timeout: seconds; past it the command's whole process tree is killed and the
                result has ``timed_out=True`` and exit code 124. None: no limit but ttl_s.
            user: run as this user, where the backend has several (None: the default user).

        Returns:
            The `ExecResult`; a non-zero exit code is returned, not raised.

        Raises:
            SandboxClosedError: the sandbox is closed or dead.
            ValueError: an empty command, or an option this backend cannot honour.
        """

    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the sandbox is open and running (False after close() or ttl_s)."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Destroy the sandbox (called once)."""

    @abc.abstractmethod
    def _close_sync(self) -> None:
        """Destroy the sandbox without an event loop (interpreter exit); best effort."""

    async def read_file(self, path: str) -> bytes:
        """The bytes of a file inside the sandbox (relative paths: under the workdir).

        Raises:
            FileNotFoundError: no such readable file.
        """
        raise NotImplementedError

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Create or replace a file inside the sandbox, making parent directories."""
        raise NotImplementedError

    async def upload_dir(self, local_dir: str | Path, remote_dir: str) -> None:
        """Copy a host directory's contents into ``remote_dir`` (created if missing).

        File modes (the executable bit) are kept; symlinks are copied as symlinks.
        """
        src = Path(local_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"upload_dir: {src} is not a directory")
        data = await asyncio.to_thread(pack_dir, src)
        tmp = f"/tmp/.miles-upload-{uuid.uuid4().hex}.tar"
        await self.write_file(tmp, data)
        dest = self.resolve(remote_dir)
        r = await self.exec(
            f"mkdir -p -- {shlex.quote(dest)} && tar -C {shlex.quote(dest)} -xf {tmp}; "
            f"rc=$?; rm -f {tmp}; exit $rc"
        )
        if r.exit_code != 0:
            raise OSError(f"upload_dir to {dest} failed (exit {r.exit_code}): {r.stderr.strip()}")

    async def download_dir(self, remote_dir: str, local_dir: str | Path) -> None:
        """Copy a sandbox directory's contents into a host directory (created if missing).

        Entries that would land outside ``local_dir`` (absolute names, ``..``, links that
        point out) are refused: the sandbox's contents are untrusted.
        """
        src = self.resolve(remote_dir)
        tmp = f"/tmp/.miles-download-{uuid.uuid4().hex}.tar"
        r = await self.exec(f"tar -C {shlex.quote(src)} -cf {tmp} .")
        if r.exit_code != 0:
            await self.exec(["rm", "-f", tmp])
            raise FileNotFoundError(f"download_dir: {src}: {r.stderr.strip()}")
        try:
            data = await self.read_file(tmp)
        finally:
            await self.exec(["rm", "-f", tmp])
        await asyncio.to_thread(unpack_tar, data, Path(local_dir))

    # -- shared helpers ----------------------------------------------------------------------

    async def close(self) -> None:
        """Destroy the sandbox and everything running in it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._close()
        finally:
            _OPEN.discard(self)

    @property
    def closed(self) -> bool:
        """close() was called."""
        return self._closed

    def resolve(self, path: str) -> str:
        """An absolute sandbox path: relative paths are taken under the workdir."""
        if not path:
            raise ValueError("empty path")
        return posixpath.normpath(posixpath.join(self.spec.workdir, path))

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosedError(f"{self.backend} sandbox {self.id} is closed")

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.id} {state}>"


def argv_of(cmd: Command) -> list[str]:
    """The argv a command runs as: a string goes through ``sh -c``."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise ValueError("exec: empty command")
        argv = ["/bin/sh", "-c", cmd]
    else:
        argv = [str(a) for a in cmd]
        if not argv or not argv[0]:
            raise ValueError("exec: empty argv")
    if any("\0" in a for a in argv):
        raise ValueError("exec: a command may not contain NUL bytes")
    return argv


def check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """Validated extra environment of one exec."""
    if not env:
        return {}
    SandboxSpec(env=dict(env))  # same rules as the spec's env
    return dict(env)


class _OpenSandboxes:
    """Every sandbox not yet closed, so interpreter exit can close them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, Sandbox] = {}

    def add(self, sb: Sandbox) -> None:
        with self._lock:
            self._items[id(sb)] = sb

    def discard(self, sb: Sandbox) -> None:
        with self._lock:
            self._items.pop(id(sb), None)

    def snapshot(self) -> list[Sandbox]:
        with self._lock:
            return list(self._items.values())

    def close_all_sync(self) -> None:
        for sb in self.snapshot():
            sb._closed = True
            try:
                sb._close_sync()
            except Exception as e:  # interpreter exit: report, go on with the others
                log.warning("closing %r at exit failed: %s", sb, e)
            self.discard(sb)


_OPEN = _OpenSandboxes()
atexit.register(_OPEN.close_all_sync)


def open_sandboxes() -> list[Sandbox]:
    """Sandboxes of this process that are not closed yet."""
    return _OPEN.snapshot()


async def create_sandbox(
    spec: SandboxSpec | Mapping[str, Any] | None = None,
    backend: str = "local",
    **options: Any,
) -> Sandbox:
    """Create a sandbox and wait until it runs commands.

    Args:
        spec: a `SandboxSpec`, a dict of its fields, or None for the defaults.
        backend: ``"local"`` (bubblewrap, the default), ``"podman"``, ``"daytona"``,
            ``"e2b"``, ``"modal"`` or ``"agentenv"``.
        **options: backend-specific options (see each backend's ``create``).

    Returns:
        The running `Sandbox`; close it with ``await sb.close()`` or ``async with``.

    Raises:
        ValueError: an invalid spec, an unknown backend, or a spec the backend cannot honour.
        ImportError: a cloud backend's SDK is not installed (the message names the extra).
    """
    sp = SandboxSpec.coerce(spec)
    target = BACKENDS.get(backend)
    if target is None:
        raise ValueError(f"unknown sandbox backend {backend!r}; choose one of {sorted(BACKENDS)}")
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    sb: Sandbox = await cls.create(sp, **options)
    return sb
