"""The podman backend: a rootful podman container per sandbox, for tasks that ship a
Dockerfile.

On the project's machines podman 4.3 works with ``runc`` (crun fails on the hybrid cgroup
layout), the cgroupfs manager and explicit ulimits within the host's hard limits; these are
passed on every call, so no containers.conf is needed. No registry is reachable: base images
come from ``debootstrap --variant=minbase`` imported with ``podman import``
(`build_base_image`), and `build_image` can point a Dockerfile's ``FROM`` at such a local image.

Each container runs as root inside but maps its uids to an unprivileged host range
(``--uidmap``), drops no-new-privileges, has memory / pids / cpu limits, runs ``sleep ttl_s``
under an init (and ``--rm``: it removes itself when ttl_s ends, also after a crash of this
process; the next `create` also removes containers whose owner process is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from miles_env.sandbox import Command, Sandbox, SandboxClosedError, argv_of, check_env
from miles_env.spec import ExecResult, SandboxSpec

__all__ = ["BASE_IMAGE", "PodmanSandbox", "available", "build_base_image", "build_image"]

BASE_IMAGE = "localhost/miles-env/debian:bookworm"
_LABEL = "miles-env.owner"
_GLOBAL = ["--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
_cleaned = False


def available(image: str = BASE_IMAGE) -> tuple[bool, str]:
    """(usable, why not): podman and runc installed, run as root, and ``image`` present."""
    for tool, pkg in (("podman", "podman"), ("runc", "runc")):
        if shutil.which(tool) is None:
            return False, f"{tool} not installed: apt-get install {pkg}"
    if os.geteuid() != 0:
        return False, "the podman backend runs rootful podman: run as root"
    r = subprocess.run(
        ["podman", *_GLOBAL, "image", "exists", image], capture_output=True, timeout=60
    )
    if r.returncode != 0:
        return False, (
            f"image {image} not found: build it with `miles-env podman-base` "
            "(debootstrap + podman import, a few minutes)"
        )
    return True, ""


def _podman(*args: str) -> list[str]:
    return ["podman", *_GLOBAL, *args]


async def _run(argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None):  # type: ignore[no-untyped-def]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    return proc.returncode, out, err


class PodmanSandbox(Sandbox):
    """A podman container (see the module docstring)."""

    backend = "podman"

    def __init__(self, spec: SandboxSpec, name: str, *, max_output_bytes: int) -> None:
        super().__init__(spec, name)
        self._counter = itertools.count()
        self._deadline = time.monotonic() + spec.ttl_s
        self._max_output = max_output_bytes

    @classmethod
    async def create(
        cls,
        spec: SandboxSpec,
        *,
        uid_base: int = 1_000_000,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> PodmanSandbox:
        """Start a container from ``spec.image`` (default `BASE_IMAGE`).

        Args:
            spec: the spec; ``rootfs`` is refused, ``network`` "none" or "public".
            uid_base: container uids 0..65535 map to host uids from
                ``uid_base + 65536 * randrange(64)`` on.
            max_output_bytes: per-stream output cap of one exec.
        """
        global _cleaned
        if spec.rootfs is not None:
            raise ValueError("the podman backend runs images, not a rootfs: set spec.image")
        if spec.allowlist is not None:
            raise ValueError(
                "the podman backend cannot enforce a network allowlist: use 'none' or "
                "'public', or a cloud backend"
            )
        image = spec.image or BASE_IMAGE
        ok, why = await asyncio.to_thread(available, image)
        if not ok:
            raise RuntimeError(f"podman backend unavailable: {why}")
        if not _cleaned:
            await asyncio.to_thread(remove_stale)
            _cleaned = True
        name = f"miles-env-{uuid.uuid4().hex[:12]}"
        host = uid_base + 65536 * random.randrange(64)
        argv = _podman(
            "run",
            "-d",
            "--rm",
            "--init",
            "--name",
            name,
            "--label",
            f"{_LABEL}={os.getpid()}",
            "--uidmap",
            f"0:{host}:65536",
            "--gidmap",
            f"0:{host}:65536",
            "--security-opt",
            "no-new-privileges",
            "--network",
            "none" if spec.network == "none" else "host",
            "--memory",
            f"{spec.memory_mb}m",
            "--memory-swap",
            f"{spec.memory_mb}m",
            "--pids-limit",
            str(spec.pids),
            "--cpus",
            f"{spec.cpus:g}",
            "--ulimit",
            "nofile=1024:8192",
            "--ulimit",
            f"nproc={spec.pids + 16}:{spec.pids + 16}",
            "--ulimit",
            f"fsize={spec.disk_mb * 1024 * 1024}",
            "--tmpfs",
            f"/tmp:size={spec.disk_mb}m,mode=1777",
        )
        for k, v in spec.env.items():
            argv += ["--env", f"{k}={v}"]
        argv += [image, "sleep", f"{spec.ttl_s:.0f}"]
        rc, _out, err = await _run(argv, timeout=300)
        if rc != 0:
            raise RuntimeError(f"podman run failed: {err.decode(errors='replace').strip()}")
        sb = cls(spec, name, max_output_bytes=max_output_bytes)
        r = await sb.exec(["mkdir", "-p", spec.workdir], cwd="/")
        if r.exit_code != 0:
            await sb.close()
            raise RuntimeError(f"podman sandbox: cannot make workdir: {r.stderr.strip()}")
        return sb

    def alive(self) -> bool:
        """Asks podman (a blocking call of a few tens of milliseconds)."""
        if self._closed:
            return False
        r = subprocess.run(
            _podman("container", "inspect", "-f", "{{.State.Running}}", self.id),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return r.returncode == 0 and r.stdout.strip() == "true"

    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> ExecResult:
        return await self._exec(argv_of(cmd), cwd=cwd, env=env, timeout=timeout, user=user)

    async def _exec(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        user: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        self._check_open()
        tag = f"{os.getpid()}-{next(self._counter)}"
        full = _podman("exec", "--workdir", self.resolve(cwd) if cwd else self.spec.workdir)
        if stdin is not None:
            full.append("-i")
        if user is not None:
            full += ["--user", user]
        # A marker every process of this command inherits: a timeout kills them by it.
        for k, v in {**check_env(env), "MILES_ENV_EXEC": tag}.items():
            full += ["--env", f"{k}={v}"]
        full += [self.id, *argv]
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *full,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            await self._kill_marked(tag)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            out, err = await proc.communicate()
        rc = proc.returncode
        assert rc is not None
        # 125: podman's own failure (e.g. the container is gone), not the command's.
        if rc == 125 and not timed_out and not await asyncio.to_thread(self.alive):
            raise SandboxClosedError(f"podman sandbox {self.id} is gone (ttl_s or removed)")
        truncated = len(out) > self._max_output or len(err) > self._max_output
        return ExecResult(
            stdout=out[: self._max_output].decode("utf-8", "replace"),
            stderr=err[: self._max_output].decode("utf-8", "replace"),
            exit_code=124 if timed_out else (128 - rc if rc < 0 else rc),
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
            truncated=truncated,
        )

    async def _kill_marked(self, tag: str) -> None:
        script = (
            "for i in 1 2 3 4 5 6 7 8; do n=0; for p in /proc/[0-9]*; do "
            f"if tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qx 'MILES_ENV_EXEC={tag}'; "
            "then kill -9 ${p#/proc/} 2>/dev/null; n=$((n+1)); fi; done; "
            '[ "$n" = 0 ] && break; done'
        )
        with contextlib.suppress(Exception):
            await _run(_podman("exec", "--user", "0", self.id, "sh", "-c", script), timeout=60)

    async def read_file(self, path: str) -> bytes:
        p = self.resolve(path)
        self._check_open()
        rc, out, err = await _run(_podman("exec", self.id, "cat", "--", p), timeout=600)
        if rc != 0:
            raise FileNotFoundError(f"{p}: {err.decode(errors='replace').strip()}")
        return bytes(out)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        p = self.resolve(path)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" -- "$1"'
        r = await self._exec(["sh", "-c", script, "sh", p, f"{mode:o}"], stdin=payload)
        if r.exit_code != 0:
            raise OSError(f"write_file {p} failed (exit {r.exit_code}): {r.stderr.strip()}")

    async def _close(self) -> None:
        await _run(_podman("rm", "-f", "-t", "0", self.id), timeout=120)

    def _close_sync(self) -> None:
        subprocess.run(_podman("rm", "-f", "-t", "0", self.id), capture_output=True, timeout=120)


def remove_stale() -> int:
    """Remove miles-env containers whose owner process is gone. Returns how many."""
    r = subprocess.run(
        _podman("ps", "-a", "--filter", f"label={_LABEL}", "--format", "{{.ID}} {{.Labels}}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    removed = 0
    for line in r.stdout.splitlines():
        cid, _, labels = line.partition(" ")
        owner = next(
            (kv.split(":")[1] for kv in labels.strip("map[]").split() if kv.startswith(_LABEL)),
            "",
        )
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            subprocess.run(_podman("rm", "-f", "-t", "0", cid), capture_output=True, timeout=120)
            removed += 1
    return removed


def build_base_image(
    tag: str = BASE_IMAGE,
    *,
    suite: str = "bookworm",
    include: Sequence[str] = ("python3",),
    mirror: str | None = None,
) -> str:
    """Make a base image without a registry: ``debootstrap --variant=minbase`` into a
    temporary directory, then ``podman import``. Needs root, debootstrap and the Debian
    package archive (a few minutes). Returns the tag."""
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap not installed: apt-get install debootstrap")
    with tempfile.TemporaryDirectory(prefix="miles-env-rootfs-") as tmp:
        root = Path(tmp) / "root"
        cmd = ["debootstrap", "--variant=minbase"]
        if include:
            cmd.append("--include=" + ",".join(include))
        cmd += [suite, str(root)]
        if mirror:
            cmd.append(mirror)
        subprocess.run(cmd, check=True, capture_output=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            subprocess.run(
                _podman("import", "-", tag), stdin=tar.stdout, check=True, capture_output=True
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
    return tag


def build_image(
    context: str | Path, tag: str, *, dockerfile: str | Path | None = None, base: str | None = None
) -> str:
    """``podman build`` a task's environment. ``base``: replace the Dockerfile's first ``FROM``
    image with this local one (no registry is reachable here). Returns the tag."""
    ctx = Path(context)
    df = Path(dockerfile) if dockerfile else ctx / "Dockerfile"
    text = df.read_text()
    if base is not None:
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.strip().upper().startswith("FROM "):
                lines[i] = f"FROM {base}"
                break
        text = "\n".join(lines) + "\n"
    with tempfile.NamedTemporaryFile("w", suffix=".Dockerfile", delete=False) as f:
        f.write(text)
    try:
        r = subprocess.run(
            _podman("build", "--pull=never", "-t", tag, "-f", f.name, str(ctx)),
            capture_output=True,
            text=True,
        )
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"podman build of {ctx} failed: {r.stderr.strip()[-2000:]}")
    return tag
