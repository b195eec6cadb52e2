"""Integrity of the bucket files: corrupted, truncated and stale files are detected on read with
a clear error; a crash in the middle of step() (a real process exit, and an I/O error) leaves
the previous step's state committed and recoverable, bit for bit."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _offload_testlib import (
    HYPER,
    TINY_BUCKET_MB,
    assert_same_params,
    assert_same_state,
    make_params,
    reference,
    run,
)

import miles_offload as mo
from miles_offload._store import NvmeStore

HERE = Path(__file__).parent


def _nvme(params: list[torch.Tensor], path: Path, **kw) -> mo.AdamW:
    return mo.AdamW(params, **HYPER, offload="nvme", path=path, bucket_mb=TINY_BUCKET_MB, **kw)


def _committed_file(path: Path, bucket: int) -> Path:
    manifest = json.loads((path / "manifest.json").read_text())
    return path / f"bucket_{bucket:06d}.{manifest['buckets'][bucket]['slot']}.bin"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("payload", "payload checksum mismatch"),
        ("header", "header checksum mismatch"),
        ("magic", "bad magic"),
        ("truncate", "truncated"),
        ("stale", "stale or overwritten"),
    ],
)
def test_damaged_files_are_detected(tmp_path: Path, damage: str, message: str) -> None:
    params = make_params()
    opt = _nvme(params, tmp_path)
    run(params, opt, range(2))
    # A bucket the next step reads (those still held in memory from this step are not read).
    bucket = min(set(range(opt.num_buckets)) - set(opt._store._kept))  # type: ignore[union-attr]
    victim = _committed_file(tmp_path, bucket)
    if damage == "payload":
        _flip(victim, os.path.getsize(victim) - 5000)
    elif damage == "header":
        _flip(victim, 40)
    elif damage == "magic":
        _flip(victim, 0)
    elif damage == "truncate":
        os.truncate(victim, os.path.getsize(victim) - 4096)
    else:  # the other slot holds the previous generation: swap it in
        other = victim.with_name(victim.name.replace(".0.bin", ".x").replace(".1.bin", ".0.bin"))
        other = other.with_name(other.name.replace(".x", ".1.bin"))
        victim.write_bytes(other.read_bytes())
    before = [p.detach().clone() for p in params]
    with pytest.raises(mo.CorruptStateError, match=message) as info:
        run(params, opt, range(2, 3))
    assert str(victim) in str(info.value)
    # The failed step changed nothing (parameters restored from the intact buckets' masters).
    assert_same_params(params, before)


def test_failed_write_keeps_the_previous_step(tmp_path: Path) -> None:
    want_p, want_sd = reference(5)
    params = make_params()
    opt = _nvme(params, tmp_path)
    run(params, opt, range(3))
    before = [p.detach().clone() for p in params]

    def fail(bucket: int) -> None:
        if bucket == 4:
            raise OSError(28, "No space left on device (injected)")

    opt._store._after_write = fail  # type: ignore[union-attr]
    with pytest.raises(OSError, match="injected"):
        run(params, opt, range(3, 4))
    assert_same_params(params, before)  # rolled back, including already-updated buckets
    opt._store._after_write = None  # type: ignore[union-attr]
    run(params, opt, range(3, 5))  # the failed step is retried as if it never happened
    assert_same_params(params, want_p)
    assert_same_state(opt.state_dict(), want_sd)


def test_full_disk_fails_before_any_byte_is_written(tmp_path: Path) -> None:
    # A real allocation failure (the file-size limit makes fallocate fail with EFBIG, as a full
    # disk fails with ENOSPC): new slot files are preallocated before the pager writes them, so
    # the step fails with a clear error, no bucket file holds any data and nothing is committed.
    want_p, want_sd = reference(3)
    params = make_params()
    opt = _nvme(params, tmp_path)
    before = [p.detach().clone() for p in params]
    committed = {f: f.read_bytes() for f in tmp_path.glob("bucket_*.bin")}  # the initial state
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        match = r"cannot allocate \d+ bytes for .*bucket_\d{6}\.[01]\.bin"
        with pytest.raises(OSError, match=match) as info:
            run(params, opt, range(1))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "previous step's state stays the committed one" in str(info.value)
    assert_same_params(params, before)
    new = [f for f in tmp_path.glob("bucket_*.bin") if f not in committed]
    assert len(new) == len(committed)
    assert all(f.stat().st_size == 0 for f in new)
    assert all(f.read_bytes() == data for f, data in committed.items())
    run(params, opt, range(3))  # with room again, as if the failed step never happened
    assert_same_params(params, want_p)
    assert_same_state(opt.state_dict(), want_sd)


def test_process_killed_mid_step_resumes_from_the_previous_step(tmp_path: Path) -> None:
    # A child process takes 3 steps, then dies (os._exit, no cleanup) after writing two buckets
    # of step 4. The parent resumes from the directory: exactly the state after step 3.
    code = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(HERE)!r})
        from _offload_testlib import HYPER, TINY_BUCKET_MB, make_params, run
        import miles_offload as mo
        params = make_params()
        opt = mo.AdamW(params, **HYPER, offload="nvme", path={str(tmp_path)!r},
                       bucket_mb=TINY_BUCKET_MB)
        run(params, opt, range(3))
        def die(bucket):
            if bucket == 1:
                os._exit(17)
        opt._store._after_write = die
        run(params, opt, range(3, 4))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 17, proc.stderr
    want_p, want_sd = reference(3)
    params = [torch.zeros_like(p).requires_grad_() for p in make_params()]
    opt = _nvme(params, tmp_path, resume=True)
    assert_same_params(params, want_p)
    assert_same_state(opt.state_dict(), want_sd)
    want_p, want_sd = reference(5)
    run(params, opt, range(3, 5))
    assert_same_params(params, want_p)
    assert_same_state(opt.state_dict(), want_sd)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("payload", "payload checksum mismatch"),
        ("truncate", "truncated"),
        ("missing", "missing bucket file"),
        ("manifest", "unreadable manifest"),
        ("version", "format version 2"),
    ],
)
def test_damaged_state_is_detected_on_resume(tmp_path: Path, damage: str, message: str) -> None:
    # A fresh process reopening the directory (resume=True) reads and verifies every bucket:
    # damage anywhere is reported with the file's name and what to do.
    params = make_params()
    opt = _nvme(params, tmp_path)
    run(params, opt, range(2))
    opt.close()
    victim = _committed_file(tmp_path, 5)
    if damage == "payload":
        _flip(victim, os.path.getsize(victim) - 100)
    elif damage == "truncate":
        os.truncate(victim, 4096)
    elif damage == "missing":
        victim.unlink()
    elif damage == "manifest":
        victim = tmp_path / "manifest.json"
        victim.write_text(victim.read_text()[:-7])  # a torn write
    else:  # the header of a newer format
        with open(victim, "r+b") as f:
            f.seek(8)
            f.write((2).to_bytes(4, "little"))
    fresh = [torch.zeros_like(p).requires_grad_() for p in params]
    with pytest.raises(mo.CorruptStateError, match=message) as info:
        _nvme(fresh, tmp_path, resume=True)
    assert str(victim) in str(info.value)
    assert "restore it from a checkpoint with load_state_dict()" in str(info.value)
    # Nothing half-applied: the buckets before the damaged one had been copied out to the
    # parameters, and are given back.
    assert all(not p.any() for p in fresh)
    # The failed optimizer released the directory: trying again meets the damage, not a lock.
    with pytest.raises(mo.CorruptStateError, match=message):
        _nvme(fresh, tmp_path, resume=True)


def test_failed_load_state_dict_keeps_the_previous_state(tmp_path: Path) -> None:
    # bf16 parameters take their values from the loaded fp32 masters: a load that fails while
    # writing (here: the fifth bucket) commits nothing and gives the parameters back.
    def steps(params: list[torch.Tensor], opt: mo.AdamW, n: int) -> None:
        g = torch.Generator().manual_seed(n)
        for _ in range(n):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()

    params = [p.detach().bfloat16().requires_grad_() for p in make_params()]
    opt = _nvme(params, tmp_path)
    steps(params, opt, 2)
    before, before_p = opt.state_dict(), [p.detach().clone() for p in params]
    other = [p.detach().bfloat16().requires_grad_() for p in make_params()]
    source = _nvme(other, tmp_path / "other")
    steps(other, source, 5)
    saved = source.state_dict()
    assert not all(torch.equal(a, b) for a, b in zip(before_p, other))

    def fail(bucket: int) -> None:
        if bucket == 4:
            raise OSError(5, "Input/output error (injected)")

    opt._store._after_write = fail  # type: ignore[union-attr]
    with pytest.raises(OSError, match="injected"):
        opt.load_state_dict(saved)
    assert_same_params(params, before_p)
    after = opt.state_dict()
    assert_same_state(after, before)
    assert all(
        torch.equal(after["state"][i]["master"], w["master"]) for i, w in before["state"].items()
    )
    opt._store._after_write = None  # type: ignore[union-attr]
    opt.load_state_dict(saved)
    assert_same_params(params, [p.detach() for p in other])
    assert_same_state(opt.state_dict(), saved)


def test_one_optimizer_per_state_directory(tmp_path: Path) -> None:
    # Two optimizers writing one directory would overwrite each other's slots and manifest:
    # the second is refused while the first is open, in this process and in another one.
    params = make_params()
    opt = _nvme(params, tmp_path)
    run(params, opt, range(2))
    with pytest.raises(RuntimeError, match=rf"{tmp_path} is in use by another .*{os.getpid()}"):
        _nvme(make_params(), tmp_path, resume=True)
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        from _offload_testlib import HYPER, TINY_BUCKET_MB, make_params
        import miles_offload as mo
        try:
            mo.AdamW(make_params(), **HYPER, offload="nvme", path={str(tmp_path)!r},
                     bucket_mb=TINY_BUCKET_MB, resume=True)
        except RuntimeError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert f"in use by another miles_offload optimizer (process {os.getpid()})" in out.stdout
    run(params, opt, range(2, 3))  # the refused ones changed nothing
    opt.close()
    # Closed: the directory is free again; a construction that fails releases it too.
    with pytest.raises(ValueError, match="another bucket layout"):
        mo.AdamW(make_params(), **HYPER, offload="nvme", path=tmp_path, resume=True, bucket_mb=1)
    fresh = [torch.zeros_like(p).requires_grad_() for p in params]
    again = _nvme(fresh, tmp_path, resume=True)
    want_p, _ = reference(3)
    assert_same_params(fresh, want_p)
    again.close()


def test_filesystem_without_locks_warns_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Some network mounts refuse flock (ENOLCK): the optimizer runs unlocked and says so.
    import miles_offload._store as store

    def no_locks(fd: object, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(store.fcntl, "flock", no_locks)
    params = make_params()
    with pytest.warns(RuntimeWarning, match=r"cannot be locked \(No locks available\)"):
        opt = _nvme(params, tmp_path)
    run(params, opt, range(2))
    want_p, _ = reference(2)
    assert_same_params(params, want_p)
    opt.close()


def test_commit_waits_for_every_sync_and_a_failed_sync_fails_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The files are flushed (fdatasync) in a thread of their own, overlapping the next
    # bucket's write; the manifest is replaced only after every flush of the step returned,
    # and a flush that fails fails the step with nothing committed.
    want_p, want_sd = reference(4)
    params = make_params()
    opt = _nvme(params, tmp_path)
    run(params, opt, range(2))
    store = opt._store
    assert isinstance(store, NvmeStore)
    real_sync, real_commit = os.fdatasync, store._commit
    synced: list[int] = []

    def slow_sync(fd: int) -> None:
        time.sleep(0.005)  # a flush still running when the last write has returned
        real_sync(fd)
        synced.append(fd)

    def commit(order: list[int], slots: list[int], generation: int) -> None:
        assert len(synced) == len(order)  # every bucket written this step is flushed
        real_commit(order, slots, generation)

    monkeypatch.setattr(os, "fdatasync", slow_sync)
    monkeypatch.setattr(store, "_commit", commit)
    run(params, opt, range(2, 3))
    assert len(synced) == opt.num_buckets

    def failing_sync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "fdatasync", failing_sync)
    before = [p.detach().clone() for p in params]
    manifest = (tmp_path / "manifest.json").read_text()
    with pytest.raises(OSError, match="injected"):
        run(params, opt, range(3, 4))
    assert_same_params(params, before)
    assert (tmp_path / "manifest.json").read_text() == manifest
    monkeypatch.setattr(os, "fdatasync", real_sync)
    run(params, opt, range(3, 4))  # retried as if the failed step never happened
    assert_same_params(params, want_p)
    assert_same_state(opt.state_dict(), want_sd)
    opt.close()


def _child_holding_the_lock(seconds: float, directory: Path) -> subprocess.Popen[bytes]:
    """A process that shares this process's open lock of `directory` (as a child forked a moment
    ago does until its at-fork hook has run) and keeps it `seconds`: exec'd with the lock's
    descriptor. Other tests' optimizers may not have been collected yet, so the lock is picked
    by its directory, not assumed to be the only one open."""
    from miles_offload import _store

    root = os.path.abspath(directory)
    (lock,) = [
        f
        for f in list(_store._LOCKS)
        if not f.closed and os.path.abspath(f.name).startswith(root + os.sep)
    ]
    code = f"import time; time.sleep({seconds})"
    return subprocess.Popen([sys.executable, "-c", code], pass_fds=(lock.fileno(),))


def test_a_lock_a_child_still_shares_is_waited_for(tmp_path: Path) -> None:
    # Right after fork() the child shares the parent's lock until its at-fork hook closes its
    # copy; a parent that closes its optimizer and reopens the directory at once must wait for
    # that, not report the directory in use by itself.
    params = make_params()
    opt = _nvme(params, tmp_path)
    run(params, opt, range(1))
    t0 = time.monotonic()
    child = _child_holding_the_lock(0.5, tmp_path)
    try:
        opt.close()
        again = _nvme(params, tmp_path, resume=True)
        # The child holds the lock for its whole 0.5 s sleep: opening earlier was impossible.
        assert time.monotonic() - t0 >= 0.5
        again.close()
    finally:
        child.kill()
        child.wait()


def test_a_child_that_keeps_the_lock_is_named_after_the_wait(tmp_path: Path, monkeypatch) -> None:
    from miles_offload import _store

    monkeypatch.setattr(_store, "_INHERITED_LOCK_WAIT_S", 0.2)
    params = make_params()
    opt = _nvme(params, tmp_path)
    child = _child_holding_the_lock(60, tmp_path)
    try:
        opt.close()
        with pytest.raises(RuntimeError, match="locked by a process forked from this one"):
            _nvme(params, tmp_path, resume=True)
    finally:
        child.kill()
        child.wait()
    _nvme(params, tmp_path, resume=True).close()  # free again once the child is gone


def test_a_second_optimizer_in_this_process_is_refused_without_waiting(
    tmp_path: Path, monkeypatch
) -> None:
    from miles_offload import _store

    def no_wait(seconds: float) -> None:
        raise AssertionError("waited for a lock this process's own optimizer holds")

    params = make_params()
    opt = _nvme(params, tmp_path)
    monkeypatch.setattr(_store.time, "sleep", no_wait)
    try:
        with pytest.raises(RuntimeError, match="in use by another miles_offload optimizer"):
            _nvme(params, tmp_path)
    finally:
        monkeypatch.undo()
        opt.close()


def test_forked_children_do_not_keep_the_directory_locked(tmp_path: Path) -> None:
    # A DataLoader worker forked while the optimizer is open must not hold its lock: after
    # the parent's close(), a new optimizer on the directory opens while the child lives.
    params = make_params()
    opt = _nvme(params, tmp_path)
    run(params, opt, range(1))
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say it is past fork, wait until the parent is done
        os.close(w)
        os.close(ready_r)
        os.write(ready_w, b"x")  # the at-fork hooks (closing our lock copy) have run
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(ready_w)
    os.read(ready_r, 1)  # not before: a child not yet scheduled still shares the lock
    os.close(ready_r)
    try:
        opt.close()
        again = _nvme(params, tmp_path, resume=True)
        again.close()
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
