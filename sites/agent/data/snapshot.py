"""Reading a directory a job wrote (its outputs, its checkpoints) without trusting it.

The job owns what it wrote and may still be writing it, or may have planted a symlink to a
file of the agent's, a FIFO, or a directory it swaps for a link mid-walk. So the walk opens
every directory and file relative to its parent's descriptor with O_NOFOLLOW (a link is never
followed, and is skipped), reads regular files only, and compares each file's (size,
mtime_ns) before and after reading it: a file that changed meanwhile is reported `unstable`
and left out, for the caller to decide (a checkpoint is not taken; an output fails).

`known` carries what the last snapshot of the same directory hashed (path -> (size,
mtime_ns, sha256)): a file whose size and mtime are unchanged is not read again, unless
`copy` needs its bytes and the store lacks its blob.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sites.agent.data.errors import BadInput
from sites.model.data import MAX_FILES, FileEntry, Manifest

CHUNK = 1 << 20
Stat = tuple[int, int, str]  # (size, mtime_ns, sha256)
# copy(sha256 or None while unknown) -> a file to write the bytes to and a commit(sha) that
# keeps them (or None: the store holds the blob already), and a discard()
Sink = Callable[[], tuple[BinaryIO, Callable[[str], None], Callable[[], None]]]


@dataclass
class Snapshot:
    files: list[FileEntry] = field(default_factory=list)
    stats: dict[str, Stat] = field(default_factory=dict)  # for the next snapshot's `known`
    unstable: list[str] = field(default_factory=list)  # changed while read: left out
    hashed: int = 0  # files read this time
    hashed_bytes: int = 0

    def manifest(self) -> Manifest:
        return Manifest(files=tuple(self.files))


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def snapshot(
    src: Path,
    *,
    known: dict[str, Stat] | None = None,
    copy: Sink | None = None,
    has_blob: Callable[[str], bool] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Snapshot:
    """The files under `src` (a directory, or one file named by its own name); see the module
    docstring. `copy`: each file read is also written through it (into a store's blobs)."""
    known = known or {}
    out = Snapshot()
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        return out
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"{src} is a symbolic link; outputs and checkpoints are read as written")
    if stat.S_ISREG(st.st_mode):
        parent = os.open(src.parent, _DIR_FLAGS)
        try:
            _take(parent, src.name, src.name, out, known, copy, has_blob)
        finally:
            os.close(parent)
        return out
    if not stat.S_ISDIR(st.st_mode):
        return out
    top = os.open(src, _DIR_FLAGS)
    try:
        _walk(top, "", out, known, copy, has_blob, skip)
    finally:
        os.close(top)
    out.files.sort(key=lambda f: f.path)
    return out


def _walk(
    dir_fd: int,
    prefix: str,
    out: Snapshot,
    known: dict[str, Stat],
    copy: Sink | None,
    has_blob: Callable[[str], bool] | None,
    skip: Callable[[str], bool] | None,
) -> None:
    with os.scandir(dir_fd) as entries:
        names = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in entries)
    for name, is_dir in names:
        rel = f"{prefix}{name}"
        if skip is not None and skip(rel):
            continue
        if is_dir:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue  # swapped for a link, or gone: not part of this snapshot
            try:
                _walk(child, f"{rel}/", out, known, copy, has_blob, skip)
            finally:
                os.close(child)
        else:
            _take(dir_fd, name, rel, out, known, copy, has_blob)
        if len(out.files) > MAX_FILES:
            raise BadInput(f"more than {MAX_FILES} files under one directory; pack them (tar)")


def _take(
    dir_fd: int,
    name: str,
    rel: str,
    out: Snapshot,
    known: dict[str, Stat],
    copy: Sink | None,
    has_blob: Callable[[str], bool] | None,
) -> None:
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(before.st_mode):
        return  # links, FIFOs, sockets, devices: never read
    was = known.get(rel)
    if (
        was is not None
        and was[0] == before.st_size
        and was[1] == before.st_mtime_ns
        and (copy is None or (has_blob is not None and has_blob(was[2])))
    ):
        out.files.append(FileEntry(path=rel, size=was[0], sha256=was[2]))
        out.stats[rel] = was
        return
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return  # swapped for a link or gone meanwhile
    sink = copy() if copy is not None else None
    kept = False
    try:
        with os.fdopen(fd, "rb") as f:
            opened = os.fstat(f.fileno())
            if not stat.S_ISREG(opened.st_mode) or opened.st_ino != before.st_ino:
                return
            digest = hashlib.sha256()
            size = 0
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                if sink is not None:
                    sink[0].write(chunk)
            after = os.fstat(f.fileno())
        if (size, after.st_size, after.st_mtime_ns) != (
            before.st_size,
            before.st_size,
            before.st_mtime_ns,
        ):
            out.unstable.append(rel)
            return
        sha = digest.hexdigest()
        if sink is not None:
            sink[1](sha)
            kept = True
        out.files.append(FileEntry(path=rel, size=size, sha256=sha))
        out.stats[rel] = (size, before.st_mtime_ns, sha)
        out.hashed += 1
        out.hashed_bytes += size
    finally:
        if sink is not None and not kept:
            sink[2]()
