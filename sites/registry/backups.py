"""Backups of the registry: etcd snapshots kept as files in one directory, with retention.

A backup is two files: `<name>.db`, the snapshot exactly as etcd's maintenance API streamed it
(etcd's own sha256 of the database at its end, which `etcdutl snapshot restore` checks), and
`<name>.json`, what was known when it was taken (`BackupInfo`: the revision, the member, the
size and the sha256 of the whole file). Both are written under a temporary name, flushed to
disk and renamed, the description last: a backup without its description is one that was
never finished, and is neither listed nor kept. The leader broker takes them on a schedule
(broker.leader.backups), `cpn backup create` on demand; docs/backup.md has the long form.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from sites.model.errors import SitesError
from sites.registry.client import Registry

__all__ = ["BackupError", "BackupInfo", "BackupStore", "backup_name", "check_backup_name"]

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"cpn-\d{8}T\d{6}(\d{3})?Z")
SUFFIX = ".db"
PARTIAL = ".part"
STALE_PART_S = 3600.0  # an unfinished file this old is a crashed take's


class BackupError(SitesError, ValueError):
    """A backup that cannot be read or used: missing, unfinished, or not what it says."""


@dataclass(frozen=True)
class BackupInfo:
    """A backup's description (its `.json`)."""

    name: str
    taken_at: float = 0.0  # unix s, when the stream began
    revision: int = 0  # etcd's revision the snapshot holds (at least: read as it began)
    member: str = ""  # host:port of the member it came from
    size_bytes: int = 0
    sha256: str = ""  # of the whole .db file
    registry: str = ""  # the endpoints it was taken through
    # the sites whose data store holds a copy checked by its sha256 (broker.ops.backup_copies)
    copies: tuple[str, ...] = ()
    # a copy sealed with the backup key (sites.kits.sealed): size_bytes and sha256 are the
    # sealed file's, these the snapshot's within
    sealed: bool = False
    plain_sha256: str = ""
    plain_size_bytes: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, text: str, where: str) -> BackupInfo:
        try:
            return cls.from_dict(json.loads(text), where)
        except ValueError as exc:
            raise BackupError(f"{where}: not a backup description: {exc}") from None

    @classmethod
    def from_dict(cls, raw: object, where: str) -> BackupInfo:
        """BackupError naming `where` when `raw` is not a description of a backup by name."""
        try:
            if not isinstance(raw, dict):
                raise TypeError("not an object")
            got = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
            got["copies"] = tuple(str(s) for s in got.get("copies") or ())
            info = cls(**got)
            check_backup_name(info.name)
            if not isinstance(info.sha256, str) or not isinstance(info.size_bytes, int):
                raise TypeError("sha256 or size_bytes of the wrong type")
        except (TypeError, BackupError) as exc:
            raise BackupError(f"{where}: not a backup description: {exc}") from None
        return info


def check_backup_name(name: str) -> str:
    """BackupError unless `name` is a backup's ('cpn-20261207T201500123Z')."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise BackupError(f"{name!r} is not a backup's name (cpn-YYYYMMDDTHHMMSSmmmZ)")
    return name


def backup_name(at: float) -> str:
    """'cpn-20261207T201500123Z': the time it was taken, to the millisecond (UTC)."""
    stamp = datetime.fromtimestamp(at, UTC)
    return f"cpn-{stamp:%Y%m%dT%H%M%S}{stamp.microsecond // 1000:03d}Z"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BackupStore:
    """The backups in `directory`, at most `keep` of them after each `take` (0: all kept)."""

    def __init__(self, directory: Path, *, keep: int = 0) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.directory = directory
        self.keep = keep

    def path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    async def take(self, registry: Registry, *, now: float) -> BackupInfo:
        """A snapshot of the registry, written whole or not at all; then the oldest beyond
        `keep` are removed. RegistryError/RegistryUnavailable from etcd, OSError from disk."""
        self.directory.mkdir(parents=True, exist_ok=True)
        name = backup_name(now)
        final = self.path(name)
        part = final.with_name(final.name + PARTIAL)
        digest = hashlib.sha256()
        size = 0
        try:
            with open(part, "wb") as f:

                def write(chunk: bytes) -> None:
                    nonlocal size
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)

                before = await registry.revision()
                member, revision = await registry.snapshot_to(write)
                revision = revision or before  # etcd 3.5 leaves the stream's header empty
                f.flush()
                os.fsync(f.fileno())
            if size == 0:
                raise BackupError(f"etcd at {registry.url} sent an empty snapshot")
            os.replace(part, final)
            info = BackupInfo(
                name=name,
                taken_at=now,
                revision=revision,
                member=member,
                size_bytes=size,
                sha256=digest.hexdigest(),
                registry=registry.url,
            )
            self._write_info(info)
        except BaseException:
            part.unlink(missing_ok=True)
            if not self.info_path(name).exists():
                final.unlink(missing_ok=True)
            raise
        log.info("backup %s: revision %d, %d bytes from %s", name, revision, size, member)
        self.prune()
        return info

    def info_path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def part_path(self, name: str) -> Path:
        """Where a copy of `name` is written until it is checked (`adopt`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return self.path(check_backup_name(name)).with_name(f"{name}{SUFFIX}{PARTIAL}")

    def adopt(self, info: BackupInfo, part: Path) -> BackupInfo:
        """Keep `part` (a copy of the backup `info` describes, received or fetched) as that
        backup once its size and sha256 match `info`, then its description: BackupError
        (and `part` removed) when they do not. A copy is never kept under its final name
        unchecked."""
        check_backup_name(info.name)
        try:
            size = part.stat().st_size
            if size != info.size_bytes:
                raise BackupError(
                    f"the copy of {info.name} has {size} bytes, its description says "
                    f"{info.size_bytes}"
                )
            found = sha256_of(part)
            if found != info.sha256:
                raise BackupError(
                    f"the copy of {info.name} has sha256 {found[:12]}..., its description "
                    f"says {info.sha256[:12]}...: damaged on its way"
                )
            with open(part, "rb") as f:
                os.fsync(f.fileno())
            os.replace(part, self.path(info.name))
            self._write_info(info)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return info

    def record_copies(self, name: str, sites: tuple[str, ...]) -> BackupInfo:
        """The description of `name` with `sites` as where its remote copies are."""
        info = self.get(name)
        if info.copies == sites:
            return info
        info = replace(info, copies=sites)
        self._write_info(info)
        return info

    def remove(self, name: str) -> bool:
        """Delete the backup `name` (its description first); False if there was none."""
        check_backup_name(name)
        found = self.info_path(name).exists() or self.path(name).exists()
        self.info_path(name).unlink(missing_ok=True)
        self.path(name).unlink(missing_ok=True)
        return found

    def bytes_held(self) -> int:
        return sum(i.size_bytes for i in self.backups())

    def _write_info(self, info: BackupInfo) -> None:
        path = self.info_path(info.name)
        part = path.with_name(path.name + PARTIAL)
        with open(part, "w") as f:
            f.write(info.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
        _fsync_dir(self.directory)

    def backups(self) -> list[BackupInfo]:
        """The finished backups, oldest first (a snapshot without its description is not one)."""
        if not self.directory.is_dir():
            return []
        out = []
        for path in self.directory.glob("cpn-*.json"):
            if not NAME_RE.fullmatch(path.stem) or not self.path(path.stem).exists():
                continue
            try:
                out.append(BackupInfo.from_json(path.read_text(), str(path)))
            except (BackupError, OSError) as exc:
                log.warning("ignoring %s: %s", path, exc)
        return sorted(out, key=lambda i: (i.taken_at, i.name))

    def get(self, name: str) -> BackupInfo:
        for info in self.backups():
            if info.name == name:
                return info
        raise BackupError(f"no backup {name!r} in {self.directory}")

    def check(self, name: str) -> BackupInfo:
        """The backup's description, once its file is read back whole and matches it."""
        info = self.get(name)
        path = self.path(name)
        size = path.stat().st_size
        if size != info.size_bytes:
            raise BackupError(f"{path}: {size} bytes, its description says {info.size_bytes}")
        found = sha256_of(path)
        if found != info.sha256:
            raise BackupError(
                f"{path}: sha256 {found[:12]}..., its description says "
                f"{info.sha256[:12]}...: the file is damaged"
            )
        return info

    def prune(self) -> list[str]:
        """Remove the oldest backups beyond `keep` (and leftovers of unfinished ones)."""
        for part in self.directory.glob(f"cpn-*{PARTIAL}"):
            if time.time() - part.stat().st_mtime > STALE_PART_S:  # not one being written now
                part.unlink(missing_ok=True)
        if self.keep == 0:
            return []
        backups = self.backups()
        gone = [info.name for info in backups[: max(0, len(backups) - self.keep)]]
        for name in gone:
            self.remove(name)
        return gone
