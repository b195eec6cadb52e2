"""What a sandbox is made of (`SandboxSpec`) and what a command returns (`ExecResult`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ExecResult", "SandboxSpec"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Mount points the sandbox itself provides: a workdir there would hide them.
_RESERVED_DIRS = ("/usr", "/etc", "/proc", "/dev", "/sys", "/bin", "/lib", "/lib64", "/sbin")


@dataclass(kw_only=True, slots=True)
class SandboxSpec:
    """One sandbox's image, limits and network, the same for every backend.

    Also accepted as a dict with these keys (`SandboxSpec.coerce`).

    Attributes:
        image: container image (podman and cloud backends), e.g. ``"python:3.12-slim"``.
            The local backend takes no image: it runs the host's read-only /usr and /etc, or
            ``rootfs``.
        rootfs: a host directory used read-only as the sandbox's root (local backend), e.g. a
            ``debootstrap`` tree. None: the host's /usr and /etc.
        workdir: absolute path of the working directory inside the sandbox; created empty and
            writable, the default ``cwd`` of `Sandbox.exec`.
        env: environment variables every command sees (on top of PATH, HOME, LANG).
        cpus: CPU share (0.5 = half a core), enforced as a CFS quota where the backend can.
        memory_mb: memory limit of the whole sandbox in MiB (every process together; on the
            local backend files written inside count too, they live in memory).
        pids: maximum number of processes and threads alive in the sandbox at once.
        disk_mb: size limit in MiB of everything written inside the sandbox.
        network: ``"none"`` (loopback only), ``"public"`` (the host's network), or an
            allowlist: a sequence of CIDRs (``"10.1.0.0/16"``) and host names that outbound
            traffic may reach (backends that cannot enforce an allowlist refuse it).
        ttl_s: lifetime in seconds; the sandbox is destroyed after it even if nobody calls
            ``close()`` (on the local backend by the kernel, on cloud backends by the provider).
    """

    image: str | None = None
    rootfs: str | None = None
    workdir: str = "/workspace"
    env: dict[str, str] = field(default_factory=dict)
    cpus: float = 1.0
    memory_mb: int = 1024
    pids: int = 256
    disk_mb: int = 1024
    network: str | tuple[str, ...] = "none"
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.image is not None and self.rootfs is not None:
            raise ValueError(
                "SandboxSpec: set image (podman, cloud backends) or rootfs (local backend), "
                "not both"
            )
        if not self.workdir.startswith("/") or self.workdir.rstrip("/") == "":
            raise ValueError(
                f"SandboxSpec.workdir must be an absolute path other than '/', got "
                f"{self.workdir!r} (e.g. '/workspace')"
            )
        if ".." in self.workdir.split("/"):
            raise ValueError(f"SandboxSpec.workdir must not contain '..': {self.workdir!r}")
        wd = self.workdir.rstrip("/")
        for reserved in _RESERVED_DIRS:
            if wd == reserved or wd.startswith(reserved + "/"):
                raise ValueError(
                    f"SandboxSpec.workdir {self.workdir!r} is under {reserved}, which the "
                    "sandbox mounts read-only: choose e.g. '/workspace' or '/app'"
                )
        self.workdir = wd
        if not isinstance(self.env, Mapping):
            raise ValueError(f"SandboxSpec.env must be a dict of str to str, got {self.env!r}")
        self.env = dict(self.env)
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise ValueError(f"SandboxSpec.env: {k!r} is not a valid variable name")
            if not isinstance(v, str) or "\0" in v:
                raise ValueError(f"SandboxSpec.env[{k!r}] must be a string without NUL bytes")
        if not self.cpus > 0:
            raise ValueError(f"SandboxSpec.cpus must be > 0, got {self.cpus}")
        if self.memory_mb < 16:
            raise ValueError(f"SandboxSpec.memory_mb must be >= 16, got {self.memory_mb}")
        if self.pids < 8:
            raise ValueError(f"SandboxSpec.pids must be >= 8, got {self.pids}")
        if self.disk_mb < 1:
            raise ValueError(f"SandboxSpec.disk_mb must be >= 1, got {self.disk_mb}")
        if not self.ttl_s > 0:
            raise ValueError(f"SandboxSpec.ttl_s must be > 0, got {self.ttl_s}")
        self.network = _check_network(self.network)

    @property
    def allowlist(self) -> tuple[str, ...] | None:
        """The network allowlist, or None for ``"none"`` / ``"public"``."""
        return self.network if isinstance(self.network, tuple) else None

    @classmethod
    def coerce(cls, spec: SandboxSpec | Mapping[str, Any] | None) -> SandboxSpec:
        """A `SandboxSpec` from a spec, a dict of its fields, or None (the defaults)."""
        if spec is None:
            return cls()
        if isinstance(spec, SandboxSpec):
            return spec
        if isinstance(spec, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(spec) - known)
            if unknown:
                raise ValueError(
                    f"SandboxSpec: unknown key(s) {unknown}; valid keys: {sorted(known)}"
                )
            return cls(**spec)
        raise ValueError(f"spec must be a SandboxSpec or a dict, got {type(spec).__name__}")

    def replace(self, **changes: Any) -> SandboxSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_network(network: Any) -> str | tuple[str, ...]:
    if isinstance(network, str):
        if network in ("none", "public"):
            return network
        raise ValueError(
            f"SandboxSpec.network must be 'none', 'public' or a list of CIDRs / host names, "
            f"got {network!r}"
        )
    if isinstance(network, Sequence) and network:
        entries = tuple(network)
        for e in entries:
            if not isinstance(e, str) or not e or any(c.isspace() for c in e):
                raise ValueError(
                    f"SandboxSpec.network allowlist entries must be CIDRs or host names, got {e!r}"
                )
        return entries
    raise ValueError(
        "SandboxSpec.network must be 'none', 'public' or a non-empty list of CIDRs / host "
        f"names, got {network!r}"
    )


@dataclass(frozen=True, slots=True)
class ExecResult:
    """What one command did. A non-zero exit is a result, never an exception.

    Attributes:
        stdout: standard output, decoded as UTF-8 (invalid bytes replaced).
        stderr: standard error, likewise.
        exit_code: the exit status; 128 + N when killed by signal N (137: SIGKILL, e.g. the
            memory limit); 124 when the timeout killed it.
        timed_out: the command ran past its ``timeout`` and its whole process tree was killed.
        duration_s: wall-clock seconds from start to exit.
        truncated: an output stream exceeded the backend's output cap; the rest was dropped.
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    duration_s: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """Exit code 0 and not timed out."""
        return self.exit_code == 0 and not self.timed_out
