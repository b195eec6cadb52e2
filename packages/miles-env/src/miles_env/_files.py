"""Tar packing of a host directory and safe unpacking of a sandbox's (untrusted) tar."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

__all__ = ["pack_dir", "unpack_tar"]


def pack_dir(src: Path) -> bytes:
    """An uncompressed tar of ``src``'s contents (names relative to it), modes kept,
    owners dropped (the sandbox user owns what it unpacks)."""

    def anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(src)):
            tar.add(src / entry, arcname=entry, recursive=True, filter=anonymous)
    return buf.getvalue()


def unpack_tar(data: bytes, dest: Path) -> None:
    """Extract a tar made inside a sandbox into ``dest``.

    Refuses (ValueError, nothing extracted) absolute names, ``..`` components, links that
    point outside ``dest``, and device or fifo entries.
    """
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        for m in members:
            _check_member(m, root)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, members=members, filter="data")
        else:  # Python < 3.10.12 / 3.11.4: the checks above are the filter
            tar.extractall(root, members=members)


def _check_member(m: tarfile.TarInfo, root: Path) -> None:
    name = m.name
    if name.startswith("/") or ".." in Path(name).parts:
        raise ValueError(f"refusing tar entry {name!r}: outside the destination")
    if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
        raise ValueError(f"refusing tar entry {name!r}: not a file, directory or link")
    if m.issym() or m.islnk():
        target = m.linkname
        base = (root / name).parent if m.issym() else root
        resolved = os.path.normpath(os.path.join(base, target))
        if os.path.isabs(target) or not (resolved + os.sep).startswith(str(root) + os.sep):
            raise ValueError(f"refusing tar entry {name!r}: link to {target!r} leaves the tree")
