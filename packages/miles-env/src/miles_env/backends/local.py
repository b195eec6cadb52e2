"""The local backend: a bubblewrap sandbox per `Sandbox`, commands entered with nsenter.

Layout of one sandbox (the default, host mode):

- a holder: ``bwrap`` started through ``setpriv`` as a per-sandbox unprivileged host uid
  (``uid_base`` + a random offset, seen inside as 65534 "nobody"), every namespace unshared
  (user, mount, pid, net, ipc, uts, cgroup), nested user namespaces disabled,
  ``--die-with-parent``, running ``sleep ttl_s``: when that ends, or when the interpreter
  dies, PID 1 of the sandbox exits and the kernel kills everything inside;
- its root: a tmpfs of ``disk_mb`` holding the workdir, /tmp and /home/sandbox (the only
  writable places, all within the one size limit), with the host's /usr and /etc bound
  read-only (or a read-only ``rootfs``), a private /proc and a minimal /dev;
- its cgroups (`cgroups.SandboxCgroups`): memory, pids and cpu limits, and a tracking
  group per exec so a timeout kills that command's whole process tree;
- ``prlimit`` (processes per uid, file size, no core dumps; address space where no memory
  cgroup exists) on the holder and every command, as a backstop.

Each `exec` runs ``setpriv --no-new-privs nsenter`` into the holder's namespaces (through
namespace file descriptors held open since creation, never by a pid that could be reused),
as the sandbox uid, with a cleared environment, in its own session. Commands started in
the background keep running until the sandbox closes, as in a container.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from miles_env._files import pack_dir, unpack_tar
from miles_env.backends.cgroups import CgroupHost, SandboxCgroups, remove_stale
from miles_env.sandbox import Command, Sandbox, SandboxClosedError, argv_of, check_env
from miles_env.spec import ExecResult, SandboxSpec

__all__ = ["LocalSandbox", "available", "local_available"]

SANDBOX_UID = 65534  # the uid (and gid) commands see inside: "nobody" in Debian's /etc/passwd
HOME = "/home/sandbox"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Output past this many bytes per stream is read and dropped (ExecResult.truncated).
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
# After a command exits, how long to wait for its output pipes to close: a process it left
# in the background may hold them open and must not block the caller.
_DRAIN_S = 0.25
_NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts")
_NSENTER_FLAG = {"user": "--user", "mnt": "--mount", "pid": "--pid", "net": "--net"}
_NSENTER_FLAG.update({"ipc": "--ipc", "uts": "--uts"})
_TOOLS = {"bwrap": "bubblewrap", "nsenter": "util-linux", "setpriv": "util-linux"}
_TOOLS["prlimit"] = "util-linux"
PRLIMIT = "prlimit"

_cgroup_host: CgroupHost | None = None


def local_available() -> tuple[bool, str]:
    """(usable, why not): the local backend needs Linux, bubblewrap and util-linux."""
    missing = sorted({pkg for tool, pkg in _TOOLS.items() if shutil.which(tool) is None})
    if missing:
        return False, f"missing {', '.join(missing)}: apt-get install {' '.join(missing)}"
    if os.geteuid() != 0:
        # Unprivileged, bwrap leaves its command in a nested user namespace that owns none of
        # the sandbox's other namespaces, so nsenter could not bring commands in.
        return False, (
            "the local backend runs as root (each sandbox gets its own unprivileged uid and "
            "cgroups): run as root, e.g. in a container"
        )
    return True, ""


def _host_cgroups() -> CgroupHost:
    global _cgroup_host
    if _cgroup_host is None:
        _cgroup_host = CgroupHost.discover()
        remove_stale(_cgroup_host)
    return _cgroup_host


@dataclass(frozen=True, slots=True)
class _Raw:
    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_s: float
    truncated: bool

    def result(self) -> ExecResult:
        return ExecResult(
            stdout=self.stdout.decode("utf-8", "replace"),
            stderr=self.stderr.decode("utf-8", "replace"),
            exit_code=self.returncode,
            timed_out=self.timed_out,
            duration_s=self.duration_s,
            truncated=self.truncated,
        )


class LocalSandbox(Sandbox):
    """A bubblewrap sandbox on this machine (see the module docstring)."""

    backend = "local"

    def __init__(
        self,
        spec: SandboxSpec,
        sandbox_id: str,
        *,
        holder: asyncio.subprocess.Process,
        pidfds: tuple[int, int],
        ns_fds: dict[str, int],
        cgroups: SandboxCgroups | None,
        host_uid: int,
        max_output_bytes: int,
    ) -> None:
        super().__init__(spec, sandbox_id)
        self._holder = holder
        self._pidfds = pidfds  # (bwrap outside, the sandbox's PID 1)
        self._ns_fds = ns_fds
        self._cg = cgroups
        self.host_uid = host_uid
        self._max_output = max_output_bytes
        self._counter = itertools.count()
        self._groups: set[str] = set()  # exec tracking groups still holding processes
        self._lingering: set[_Capture] = set()  # output pipes a background process holds
        self._deadline = time.monotonic() + spec.ttl_s

    # -- creation ----------------------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        spec: SandboxSpec,
        *,
        cgroups: bool = True,
        uid_base: int = 200_000,
        uid_span: int = 100_000,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        start_timeout_s: float = 30.0,
    ) -> LocalSandbox:
        """Start a sandbox.

        Args:
            spec: the spec (``image`` is refused; ``network`` may be "none" or "public").
            cgroups: use cgroups for limits and process tracking where writable (False:
                prlimit only, timeouts kill the command's process group).
            uid_base: sandboxes run as host uid ``uid_base + randrange(uid_span)``.
            uid_span: see uid_base.
            max_output_bytes: per-stream output cap of one exec.
            start_timeout_s: how long the sandbox may take to start.
        """
        ok, why = local_available()
        if not ok:
            raise RuntimeError(f"local sandbox backend unavailable: {why}")
        _check_spec(spec)
        host_uid = uid_base + random.randrange(uid_span)
        sandbox_id = uuid.uuid4().hex[:12]
        cg = None
        if cgroups:
            host = _host_cgroups()
            cg = SandboxCgroups.create(
                f"{os.getpid()}-{sandbox_id}",
                memory_mb=spec.memory_mb,
                pids=spec.pids,
                cpus=spec.cpus,
                host=host,
            )
        info_r, info_w = os.pipe()
        proc = None
        pidfds: tuple[int, ...] = ()
        try:
            argv = [
                *_wrapper(spec, cg, cg.procs_files() if cg else [], holder=True),
                "setpriv",
                f"--reuid={host_uid}",
                f"--regid={host_uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--",
                *_bwrap_argv(spec, info_fd=info_w),
            ]
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(info_w,),
                start_new_session=True,
                env={"PATH": PATH},
            )
            os.close(info_w)
            info_w = -1
            raw = await asyncio.wait_for(asyncio.to_thread(_read_all, info_r), start_timeout_s)
            if not raw:
                assert proc.stderr is not None
                err = (await proc.stderr.read()).decode(errors="replace").strip()
                await proc.wait()
                raise RuntimeError(f"local sandbox failed to start: {err or 'no reason given'}")
            child = int(json.loads(raw)["child-pid"])
            # pidfds: signals reach these processes and no other, even once their pids are
            # free for reuse. bwrap (our child) is not reaped yet; its child (the sandbox's
            # PID 1) is alive while bwrap is, and bwrap waits for it.
            pidfds = (os.pidfd_open(proc.pid), os.pidfd_open(child))
            ns_fds = await asyncio.wait_for(_open_namespaces(child), start_timeout_s)
        except BaseException:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            for fd in pidfds:
                os.close(fd)
            if cg is not None:
                await asyncio.to_thread(cg.remove)
            raise
        finally:
            os.close(info_r)
            if info_w >= 0:
                os.close(info_w)
        return cls(
            spec,
            sandbox_id,
            holder=proc,
            pidfds=(pidfds[0], pidfds[1]),
            ns_fds=ns_fds,
            cgroups=cg,
            host_uid=host_uid,
            max_output_bytes=max_output_bytes,
        )

    # -- the protocol ------------------------------------------------------------------------

    def alive(self) -> bool:
        return not self._closed and self._holder.returncode is None

    @property
    def enforced(self) -> dict[str, str | None]:
        """Which limits are in force and how: {"memory": "v1"|"v2"|None, ..., "kill": ...}."""
        if self._cg is None:
            return {"memory": None, "pids": None, "cpu": None, "kill": None}
        return dict(self._cg.enforced)

    def oom_kills(self) -> int:
        """Processes the sandbox's memory limit has killed so far."""
        return self._cg.oom_kills() if self._cg is not None else 0

    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> ExecResult:
        if user not in (None, "nobody", "sandbox"):
            raise ValueError(
                f"exec(user={user!r}): the local backend runs every command as its one "
                "unprivileged user; use the podman or a cloud backend for other users"
            )
        raw = await self._run(argv_of(cmd), cwd=cwd, env=check_env(env), timeout=timeout)
        return raw.result()

    async def read_file(self, path: str) -> bytes:
        p = self.resolve(path)
        raw = await self._run(["cat", "--", p])
        if raw.returncode != 0:
            raise FileNotFoundError(f"{p}: {raw.stderr.decode(errors='replace').strip()}")
        if raw.truncated:
            raise OSError(f"{p} is larger than max_output_bytes={self._max_output}")
        return raw.stdout

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        p = self.resolve(path)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" -- "$1"'
        raw = await self._run(["/bin/sh", "-c", script, "sh", p, f"{mode:o}"], stdin=payload)
        if raw.returncode != 0:
            err = raw.stderr.decode(errors="replace").strip()
            raise OSError(f"write_file {p} failed (exit {raw.returncode}): {err}")

    async def upload_dir(self, local_dir: str | Path, remote_dir: str) -> None:
        src = Path(local_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"upload_dir: {src} is not a directory")
        data = await asyncio.to_thread(pack_dir, src)
        dest = self.resolve(remote_dir)
        script = 'mkdir -p -- "$1" && tar -C "$1" -xf -'
        raw = await self._run(["/bin/sh", "-c", script, "sh", dest], stdin=data)
        if raw.returncode != 0:
            err = raw.stderr.decode(errors="replace").strip()
            raise OSError(f"upload_dir to {dest} failed (exit {raw.returncode}): {err}")

    async def download_dir(self, remote_dir: str, local_dir: str | Path) -> None:
        src = self.resolve(remote_dir)
        raw = await self._run(["tar", "-C", src, "-cf", "-", "."])
        if raw.returncode != 0:
            err = raw.stderr.decode(errors="replace").strip()
            raise FileNotFoundError(f"download_dir: {src}: {err}")
        if raw.truncated:
            raise OSError(f"download_dir: {src} is larger than max_output_bytes={self._max_output}")
        await asyncio.to_thread(unpack_tar, raw.stdout, Path(local_dir))

    # -- running one command -----------------------------------------------------------------

    async def _run(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> _Raw:
        self._check_open()
        if not self.alive():
            raise SandboxClosedError(self._death_reason())
        if timeout is not None and not timeout > 0:
            raise ValueError(f"exec: timeout must be > 0 seconds, got {timeout}")
        group = f"e{next(self._counter)}"
        procs = self._cg.procs_files(group) if self._cg is not None else []
        wd = self.resolve(cwd) if cwd else self.spec.workdir
        full_env = {"PATH": PATH, "HOME": HOME, "LANG": "C.UTF-8", "USER": "nobody"}
        full_env.update(self.spec.env)
        full_env.update(env or {})
        inner = list(argv)
        if "=" in inner[0]:  # env(1) would take it for an assignment
            inner = ["/bin/sh", "-c", 'exec "$@"', "sh", *inner]
        nsenter = ["nsenter"]
        nsenter += [f"{_NSENTER_FLAG[ns]}=/proc/self/fd/{fd}" for ns, fd in self._ns_fds.items()]
        nsenter += [f"--wdns={wd}", f"--setuid={SANDBOX_UID}", f"--setgid={SANDBOX_UID}", "--"]
        cmdline = [
            *_wrapper(self.spec, self._cg, procs, holder=False),
            "setpriv",
            "--no-new-privs",
            "--",
            *nsenter,
            "/usr/bin/env",
            "-i",
            *(f"{k}={v}" for k, v in full_env.items()),
            *inner,
        ]
        start = time.monotonic()
        # Output goes through pipes of our own, not asyncio's: asyncio's wait() also waits
        # for its pipes to close, which a process left in the background would prevent.
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        out = _Capture(out_r, self._max_output, loop)
        err = _Capture(err_r, self._max_output, loop)
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmdline,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                pass_fds=tuple(self._ns_fds.values()),
                start_new_session=True,
                env={"PATH": PATH},
            )
        except BaseException:
            out.close()
            err.close()
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        feeder = asyncio.ensure_future(_feed(proc, stdin)) if stdin is not None else None
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                timed_out = True
                await self._kill_tree(proc, group)
        except BaseException:  # cancelled: the command must not outlive its caller
            await asyncio.shield(self._kill_tree(proc, group))
            raise
        finally:
            if feeder is not None:
                feeder.cancel()
            waits = [asyncio.ensure_future(c.eof.wait()) for c in (out, err)]
            _done, pending = await asyncio.wait(waits, timeout=_DRAIN_S)
            for w in pending:
                w.cancel()
            for c in (out, err):
                if not c.eof.is_set():  # held open by a background process: drain, discard
                    c.detach()
                    self._lingering.add(c)
            self._release_groups(group)
        rc = proc.returncode
        assert rc is not None
        if timed_out:
            rc = 124
        elif rc < 0:
            rc = 128 - rc
        if rc != 0 and (not self.alive() or await self._ttl_ended()):
            raise SandboxClosedError(self._death_reason())
        return _Raw(
            returncode=rc,
            stdout=bytes(out.data),
            stderr=bytes(err.data),
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
            truncated=out.dropped > 0 or err.dropped > 0,
        )

    def _release_groups(self, group: str) -> None:
        """Remove this exec's tracking group, and those of earlier execs whose background
        processes have ended since (a group stays while a process runs in it)."""
        if self._cg is None:
            return
        self._groups.add(group)
        self._groups = {g for g in self._groups if not self._cg.release(g)}
        for c in [c for c in self._lingering if c.fd < 0]:  # pipes whose writers ended
            self._lingering.discard(c)

    async def _kill_tree(self, proc: asyncio.subprocess.Process, group: str) -> None:
        if self._cg is not None and self._cg.tracker is not None:
            await asyncio.to_thread(self._cg.kill, group)
        else:  # no cgroups: the command's session (processes that setsid again escape)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def _ttl_ended(self) -> bool:
        """Past the deadline, whether the holder is gone: the command can be reaped before the
        event loop has seen the holder's exit, so wait a moment for it (seen under load: a
        command killed by the ttl came back as an ordinary failure)."""
        if time.monotonic() < self._deadline - 0.05:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._holder.wait()), timeout=2.0)
        return not self.alive()

    def _death_reason(self) -> str:
        if self._closed:
            return f"local sandbox {self.id} is closed"
        if time.monotonic() >= self._deadline - 0.05:
            return (
                f"local sandbox {self.id} reached its ttl_s={self.spec.ttl_s:g} and was destroyed"
            )
        return f"local sandbox {self.id} died (holder exit status {self._holder.returncode})"

    # -- closing -----------------------------------------------------------------------------

    async def _close(self) -> None:
        # The sandbox's PID 1 first: the kernel kills everything in its PID namespace and
        # bwrap, its parent, reaps it and exits (killing bwrap first would leave PID 1 a
        # zombie for the host's init to reap).
        _pidfd_kill(self._pidfds[1])
        try:
            await asyncio.wait_for(self._holder.wait(), 10)
        except asyncio.TimeoutError:
            _pidfd_kill(self._pidfds[0])
            await self._holder.wait()
        await asyncio.to_thread(self._release)

    def _close_sync(self) -> None:
        _pidfd_kill(self._pidfds[1])
        end = time.monotonic() + 10
        while _running(self._holder.pid) and time.monotonic() < end:
            time.sleep(0.002)
        _pidfd_kill(self._pidfds[0])
        self._release()

    def _release(self) -> None:
        # The cgroup kill also takes the host-side nsenter processes of running commands.
        if self._cg is not None:
            self._cg.remove()
        for c in list(self._lingering):
            with contextlib.suppress(Exception):
                c.close()
        self._lingering.clear()
        for fd in [*self._ns_fds.values(), *self._pidfds]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ns_fds = {}
        self._pidfds = (-1, -1)


def _pidfd_kill(pidfd: int) -> None:
    if pidfd >= 0:
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie bwrap has exited; its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class _Capture:
    """Reads one output pipe on the event loop: keeps the first ``limit`` bytes, counts the
    rest. Detached, it goes on reading and discarding until EOF (so a background process
    writing to it never gets SIGPIPE) or until closed with the sandbox."""

    def __init__(self, fd: int, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = fd
        self.data = bytearray()
        self.limit = limit
        self.dropped = 0
        self.eof = asyncio.Event()
        self._keep = True
        self._loop = loop
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            self.eof.set()
            return
        if self._keep:
            room = max(self.limit - len(self.data), 0)
            self.data += chunk[:room]
            self.dropped += len(chunk) - min(room, len(chunk))

    def detach(self) -> None:
        self._keep = False

    def close(self) -> None:
        if self.fd < 0:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()


def _check_spec(spec: SandboxSpec) -> None:
    if spec.image is not None:
        raise ValueError(
            f"the local backend runs no container images (spec.image={spec.image!r}): use "
            "backend='podman' or a cloud backend, or give a rootfs directory"
        )
    if spec.allowlist is not None:
        raise ValueError(
            "the local backend cannot enforce a network allowlist: use network='none' or "
            "'public', or a backend that filters egress (daytona, e2b, modal)"
        )
    if spec.rootfs is not None and not Path(spec.rootfs, "bin").exists():
        raise ValueError(f"spec.rootfs {spec.rootfs!r} is not a root filesystem (no bin/)")


# dash's ulimit sets the limits in the shell that joins the cgroups, saving an exec of
# prlimit per command (about a tenth of an exec's cost); other shells get prlimit.
_DASH = os.path.realpath("/bin/sh").endswith("dash")


def _wrapper(
    spec: SandboxSpec, cg: SandboxCgroups | None, procs_files: list[str], *, holder: bool
) -> list[str]:
    """The argv prefix every sandbox process starts with: a shell that sets the rlimits,
    moves itself into the cgroups and execs the rest of argv (prlimit where /bin/sh is not
    dash)."""
    limits = _limits(spec, cg)
    script = ""
    if _DASH:
        for flag, value in _dash_ulimits(limits).items():
            script += f"ulimit -{flag} {value} || exit 125; "
    # The holder asks to be spared by the OOM killer (best effort: some kernels refuse a
    # negative value); its processes allocate next to nothing, so the memory limit's victim
    # is a command anyway.
    if holder:
        script += "echo -1000 > /proc/self/oom_score_adj 2>/dev/null; "
    script += 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
    argv = ["/bin/sh", "-c", script, "sh", *procs_files, "--"]
    if not _DASH:
        argv += [PRLIMIT, *(f"--{k}={v}" for k, v in limits.items()), "--"]
    return argv


def _limits(spec: SandboxSpec, cg: SandboxCgroups | None) -> dict[str, int]:
    """prlimit-style limits: processes of the sandbox's uid, file size, core, address space."""
    # The pids cgroup is the limit; RLIMIT_NPROC (processes of the sandbox's uid) the backstop,
    # a little above it so that the cgroup is what a fork bomb meets where it exists.
    nproc = spec.pids if cg is None or cg.enforced.get("pids") is None else spec.pids + 16
    limits = {"nproc": nproc, "fsize": spec.disk_mb * 1024 * 1024, "core": 0}
    if cg is None or cg.enforced.get("memory") is None:
        # No memory cgroup: cap each process's address space instead (breaks programs that
        # reserve much more than they use, hence only as the fallback).
        limits["as"] = spec.memory_mb * 1024 * 1024
    return limits


def _dash_ulimits(limits: dict[str, int]) -> dict[str, int]:
    """dash's ulimit flags and units (file size in 512-byte blocks, address space in KiB)."""
    out = {"p": limits["nproc"], "f": limits["fsize"] // 512, "c": limits["core"]}
    if "as" in limits:
        out["v"] = limits["as"] // 1024
    return out


def _bwrap_argv(spec: SandboxSpec, *, info_fd: int) -> list[str]:
    # --disable-userns: no user namespaces inside (no unprivileged-userns attack surface).
    a = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns"]
    if spec.network == "public":
        a.append("--share-net")
    a += ["--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox"]
    a += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]  # seen inside as "nobody"
    a += ["--size", str(spec.disk_mb * 1024 * 1024), "--tmpfs", "/"]
    root = Path(spec.rootfs) if spec.rootfs is not None else None
    a += _root_binds(root)
    a += ["--proc", "/proc", "--dev", "/dev"]
    a += ["--dir", "/tmp", "--chmod", "1777", "/tmp", "--dir", HOME, "--dir", spec.workdir]
    a += ["--chdir", spec.workdir, "--info-fd", str(info_fd)]
    sleep = "/usr/bin/sleep" if root is None or (root / "usr/bin/sleep").exists() else "/bin/sleep"
    return [*a, "--", sleep, f"{spec.ttl_s:.3f}"]


def _root_binds(rootfs: Path | None) -> list[str]:
    """Read-only binds of the host's /usr and /etc (and /bin, /lib... as links or binds),
    or of every top-level entry of a rootfs except the ones the sandbox makes itself."""
    a: list[str] = []
    if rootfs is None:
        entries = [Path(p) for p in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/lib32")]
        entries += [Path("/libx32")]
    else:
        skip = {"proc", "dev", "sys", "tmp", "run", "home"}
        entries = sorted(p for p in rootfs.iterdir() if p.name not in skip)
    for p in entries:
        dest = "/" + p.name
        if p.is_symlink():
            a += ["--symlink", os.readlink(p), dest]
        elif p.is_dir():
            a += ["--ro-bind", str(p), dest]
    return a


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def _open_namespaces(child: int) -> dict[str, int]:
    """Open the namespaces of the sandbox's command (bwrap's child), once it runs."""
    pause = 0.001
    while True:
        try:
            kids = Path(f"/proc/{child}/task/{child}/children").read_text().split()
        except FileNotFoundError:
            raise RuntimeError("local sandbox exited while starting") from None
        if kids:
            break
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.002)
    pid = int(kids[0])
    fds: dict[str, int] = {}
    try:
        for ns in _NAMESPACES:
            fds[ns] = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def available() -> tuple[bool, str]:
    """(usable, why not) of the local backend."""
    return local_available()
