"""Per-sandbox cgroups: memory / pids / cpu limits and a kill switch for a process tree.

Works on cgroup v1, v2 and the hybrid layout (v1 controllers plus an empty v2 hierarchy, as
on the project's machines: memory, pids, cpu and freezer under /sys/fs/cgroup/<controller>,
cgroup2 at /sys/fs/cgroup/unified). Groups are made under this process's own cgroup, as
``<own>/miles-env/<hostpid>-<sandbox id>``; each exec gets a child group ``e<n>`` there that
tracks its whole process tree however it forks, setsids or daemonizes, so a timeout can kill
exactly that tree.

Limits come from v1 controllers where mounted, else from v2 where the controller can be
enabled; tracking from v2 (``cgroup.kill``) where a v2 hierarchy is writable, else from the
v1 freezer (freeze, SIGKILL every member, thaw). What is in force is in `enforced`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CgroupHost", "SandboxCgroups"]

_GROUP = "miles-env"
_LIMIT_CONTROLLERS = ("memory", "pids", "cpu")


@dataclass(slots=True)
class CgroupHost:
    """Where this process's cgroups are: one base directory per v1 controller, the v2 base."""

    v1: dict[str, Path] = field(default_factory=dict)
    v2: Path | None = None
    v2_controllers: frozenset[str] = frozenset()

    @classmethod
    def discover(cls) -> CgroupHost:
        """Read /proc/self/mountinfo and /proc/self/cgroup; keep only writable bases."""
        host = cls()
        try:
            own = _own_cgroups()
            mounts = _cgroup_mounts()
        except OSError:
            return host
        for mountpoint, fstype, root, opts in mounts:
            if fstype == "cgroup2":
                path = own.get("")
                if path is None or host.v2 is not None:
                    continue
                base = _under(Path(mountpoint), root, path)
                if base is not None and os.access(base, os.W_OK):
                    host.v2 = base
                    with contextlib.suppress(OSError):
                        names = (base / "cgroup.controllers").read_text().split()
                        host.v2_controllers = frozenset(names)
            elif fstype == "cgroup":
                for ctrl in opts:
                    if ctrl not in (*_LIMIT_CONTROLLERS, "freezer") or ctrl in host.v1:
                        continue
                    path = next((p for k, p in own.items() if ctrl in k.split(",")), None)
                    if path is None:
                        continue
                    base = _under(Path(mountpoint), root, path)
                    if base is not None and os.access(base, os.W_OK):
                        host.v1[ctrl] = base
        return host


def _own_cgroups() -> dict[str, str]:
    """controllers ("memory", "cpu,cpuacct", "" for v2) -> this process's cgroup path."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        out[ctrls] = path
    return out


def _cgroup_mounts() -> list[tuple[str, str, str, list[str]]]:
    """(mountpoint, fstype, root within the hierarchy, super options) of cgroup mounts."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(post_fields) < 3 or post_fields[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((fields[4], post_fields[0], fields[3], post_fields[2].split(",")))
    return out


def _under(mountpoint: Path, root: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` on a mount of the hierarchy's ``root``."""
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    rel = os.path.relpath(path, root)
    base = mountpoint if rel == "." else mountpoint / rel
    return base if base.is_dir() else None


class SandboxCgroups:
    """The cgroups of one sandbox. Create with `SandboxCgroups.create`."""

    def __init__(self, name: str, host: CgroupHost) -> None:
        self.name = name
        self._host = host
        self.limit_dirs: dict[str, Path] = {}  # controller -> sandbox group, v1 or v2
        self.v1_dirs: list[Path] = []  # every v1 group made (removed at close)
        self.v2_dir: Path | None = None
        self.tracker: str | None = None  # "cgroup.kill" | "freezer" | None
        self._track_dir: Path | None = None
        self.enforced: dict[str, str | None] = {}

    @classmethod
    def create(
        cls, name: str, *, memory_mb: int, pids: int, cpus: float, host: CgroupHost
    ) -> SandboxCgroups:
        """Make the groups and set the limits; any part the host lacks is left out."""
        cg = cls(name, host)
        try:
            cg._make(memory_mb=memory_mb, pids=pids, cpus=cpus)
        except BaseException:
            cg.remove()
            raise
        return cg

    def _make(self, *, memory_mb: int, pids: int, cpus: float) -> None:
        host = self._host
        # The v1 freezer tracks processes only where no v2 hierarchy can (cgroup.kill).
        track_v1 = ("freezer",) if host.v2 is None else ()
        for ctrl in (*_LIMIT_CONTROLLERS, *track_v1):
            base = host.v1.get(ctrl)
            if base is None:
                continue
            d = base / _GROUP / self.name
            d.mkdir(parents=True, exist_ok=True)
            self.v1_dirs.append(d)
            if ctrl == "freezer":
                self._track_dir, self.tracker = d, "freezer"
            else:
                self.limit_dirs[ctrl] = d
        if host.v2 is not None:
            parent = host.v2 / _GROUP
            parent.mkdir(exist_ok=True)
            wanted = [c for c in _LIMIT_CONTROLLERS if c not in self.limit_dirs]
            enabled = _enable_v2(host.v2, parent, wanted, host.v2_controllers)
            self.v2_dir = parent / self.name
            self.v2_dir.mkdir(exist_ok=True)
            for c in enabled:
                self.limit_dirs[c] = self.v2_dir
            self._track_dir, self.tracker = self.v2_dir, "cgroup.kill"
        mem = memory_mb * 1024 * 1024
        for ctrl, d in self.limit_dirs.items():
            v2 = d == self.v2_dir
            if ctrl == "memory":
                if v2:
                    _write(d / "memory.max", str(mem))
                    _try_write(d / "memory.swap.max", "0")
                else:
                    _write(d / "memory.limit_in_bytes", str(mem))
                    _try_write(d / "memory.memsw.limit_in_bytes", str(mem))
            elif ctrl == "pids":
                _write(d / "pids.max", str(pids))
            elif ctrl == "cpu":
                period = 100_000
                quota = max(1000, int(cpus * period))
                if v2:
                    _write(d / "cpu.max", f"{quota} {period}")
                else:
                    _write(d / "cpu.cfs_period_us", str(period))
                    _write(d / "cpu.cfs_quota_us", str(quota))
            self.enforced[ctrl] = "v2" if v2 else "v1"
        for ctrl in _LIMIT_CONTROLLERS:
            self.enforced.setdefault(ctrl, None)
        self.enforced["kill"] = self.tracker

    # -- membership --------------------------------------------------------------------------

    def procs_files(self, exec_group: str | None = None) -> list[str]:
        """cgroup.procs files a new process writes its pid to: the limit groups, and the
        tracking group (``exec_group``'s child of it, made here, when given)."""
        files = {str(d / "cgroup.procs") for d in self.limit_dirs.values()}
        if self._track_dir is not None:
            track = self._track_dir
            if exec_group is not None:
                track = track / exec_group
                track.mkdir(exist_ok=True)
            files.discard(str(self._track_dir / "cgroup.procs"))
            files.add(str(track / "cgroup.procs"))
        return sorted(files)

    def members(self, exec_group: str | None = None) -> list[int]:
        """Pids in the tracking group (or one exec's child group), children included."""
        if self._track_dir is None:
            return []
        d = self._track_dir if exec_group is None else self._track_dir / exec_group
        return _pids_below(d)

    # -- killing -----------------------------------------------------------------------------

    def kill(self, exec_group: str | None = None, *, deadline_s: float = 10.0) -> bool:
        """SIGKILL every process of the sandbox (or of one exec) and wait until none is left.

        Returns:
            True when the group is empty, False when processes were still there at the
            deadline (uninterruptible sleep) or no tracker exists.
        """
        if self._track_dir is None:
            return False
        d = self._track_dir if exec_group is None else self._track_dir / exec_group
        if not d.is_dir():
            return True
        end = time.monotonic() + deadline_s
        if self.tracker == "cgroup.kill":
            _try_write(d / "cgroup.kill", "1")
        else:
            _freeze_kill_thaw(d, end)
        pause = 0.001
        while _pids_below(d):
            if time.monotonic() > end:
                return False
            if self.tracker == "freezer":
                _freeze_kill_thaw(d, end)
            else:
                _try_write(d / "cgroup.kill", "1")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return True

    def release(self, exec_group: str) -> bool:
        """Remove one exec's tracking group if nothing runs in it any more."""
        if self._track_dir is None:
            return True
        d = self._track_dir / exec_group
        try:
            d.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

    def remove(self) -> None:
        """Kill what is left, then remove every group this sandbox made."""
        if self._track_dir is not None and self._track_dir.is_dir():
            self.kill()
        dirs = [*self.v1_dirs, *([self.v2_dir] if self.v2_dir is not None else [])]
        for d in dirs:
            _rmtree_cgroup(d)

    def oom_kills(self) -> int:
        """How many processes the memory limit killed so far (0 where not reported)."""
        d = self.limit_dirs.get("memory")
        if d is None:
            return 0
        name = "memory.events" if d == self.v2_dir else "memory.oom_control"
        try:
            for line in (d / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0


def _enable_v2(root: Path, parent: Path, wanted: list[str], available: frozenset[str]) -> list[str]:
    """Enable v2 controllers down to ``parent``'s children; those that could be enabled."""
    got = []
    for c in wanted:
        if c not in available:
            continue
        try:
            _write(root / "cgroup.subtree_control", f"+{c}")
            _write(parent / "cgroup.subtree_control", f"+{c}")
        except OSError:  # e.g. EBUSY: our own cgroup holds processes (no internal processes)
            continue
        got.append(c)
    return got


def _freeze_kill_thaw(d: Path, end: float) -> None:
    state = d / "freezer.state"
    _try_write(state, "FROZEN")
    while time.monotonic() < end:
        try:
            if state.read_text().strip() == "FROZEN":
                break
        except OSError:
            break
        time.sleep(0.001)
    for pid in _pids_below(d):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    _try_write(state, "THAWED")


def _pids_below(d: Path) -> list[int]:
    pids: list[int] = []
    for root, _dirs, files in os.walk(d):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids.extend(int(x) for x in Path(root, "cgroup.procs").read_text().split())
    return pids


def _rmtree_cgroup(d: Path) -> None:
    """rmdir a cgroup and its children, deepest first (cgroup files cannot be unlinked)."""
    if not d.is_dir():
        return
    for root, dirs, _files in os.walk(d, topdown=False):
        for sub in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, sub))
    with contextlib.suppress(OSError):
        d.rmdir()


def remove_stale(host: CgroupHost) -> int:
    """Remove groups left by dead processes (a killed interpreter cannot clean up after
    itself: its sandboxes died with it, their empty groups stay). Returns how many."""
    removed = 0
    bases = [b / _GROUP for b in host.v1.values()]
    if host.v2 is not None:
        bases.append(host.v2 / _GROUP)
    for base in bases:
        if not base.is_dir():
            continue
        for entry in base.iterdir():
            owner, _, _ = entry.name.partition("-")
            if not entry.is_dir() or not owner.isdigit() or _alive(int(owner)):
                continue
            for pid in _pids_below(entry):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            _rmtree_cgroup(entry)
            removed += not entry.exists()
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _try_write(path: Path, value: str) -> bool:
    try:
        _write(path, value)
    except OSError:
        return False
    return True
