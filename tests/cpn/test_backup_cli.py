"""`cpn backup create|ls|fetch|verify`, `cpn restore`, `cpn recovery` (cpn.backup_cli) against the
session's etcd: what they print, and each bad input refused with exit 2 and one line."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from cpn import cli
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model.errors import PermissionDenied
from sites.registry.backups import BackupStore
from sites.registry.security import BROKER_USER, ROOT_USER
from tests.sites.registry.test_etcd_security import SecureEtcd, secure  # noqa: F401 - its fixture


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    assert err.startswith("cpn: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def backed_up(
    etcd: EmbeddedEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[Path, dict[str, object]]:
    code, out, err = run(
        capsys, "backup", "create", "--etcd", etcd.url, "--dir", str(tmp_path), "-o", "json"
    )
    assert code == 0, err
    return tmp_path, json.loads(out)


@pytest.mark.e2e  # verify and restore start a scratch etcd
def test_a_backup_is_listed_verified_and_restored(
    backed_up: tuple[Path, dict[str, object]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where, info = backed_up
    name = str(info["name"])
    code, out, _ = run(capsys, "backup", "ls", "--dir", str(where))
    assert code == 0 and name in out
    code, out, err = run(capsys, "backup", "verify", "--dir", str(where))  # the newest
    assert code == 0, err
    assert "ok: size and sha256 match its description" in out and "restored and read back" in out
    assert name in out
    data = tmp_path / "restored"
    code, out, err = run(capsys, "restore", name, "--dir", str(where), "--data-dir", str(data))
    assert code == 0, err
    assert (data / "cpn" / "member").is_dir()
    assert "start: etcd --name cpn" in out and "cpn recovery --wait" in out
    # never over a directory that exists
    err = refused(capsys, "restore", name, "--dir", str(where), "--data-dir", str(data))
    assert "exists: restore into a new directory" in err


@pytest.mark.e2e
def test_a_damaged_or_foreign_snapshot_is_refused_in_one_line(
    backed_up: tuple[Path, dict[str, object]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where, info = backed_up
    path = where / f"{info['name']}.db"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "the file is damaged" in refused(capsys, "backup", "verify", str(path))
    foreign = tmp_path / "foreign.db"
    foreign.write_bytes(b"not a snapshot" * 100)
    assert "etcdutl snapshot status" in refused(capsys, "backup", "verify", str(foreign))
    assert "no such snapshot file" in refused(
        capsys, "backup", "verify", str(tmp_path / "missing.db")
    )
    assert "no backup in" in refused(capsys, "backup", "verify", "--dir", str(tmp_path / "none"))


def test_a_restore_with_bad_members_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = str(tmp_path / "x.db")
    base = ("restore", snap, "--data-dir", str(tmp_path / "d"))
    assert "expected NAME=http(s)://HOST:PORT" in refused(capsys, *base, "--member", "cpn0")
    two = ("--member", "a=http://127.0.0.1:1", "--member", "b=http://127.0.0.1:2")
    assert "no quorum" in refused(capsys, *base, *two)
    assert "--collect-s: must be > 0" in refused(capsys, *base, "--collect-s", "0")
    assert "--wait: must be >= 0" in refused(capsys, *base, "--wait", "-1")
    assert not (tmp_path / "d").exists()  # nothing written for a refused command


def test_bad_copies_and_fetches_are_refused_in_one_line(
    etcd: EmbeddedEtcd,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = ("--dir", str(tmp_path))
    assert "--copies: must be >= 0" in refused(
        capsys, "backup", "create", "--etcd", etcd.url, *d, "--copies", "-1"
    )
    assert "is not a backup's name" in refused(capsys, "backup", "fetch", "x.db", *d)
    assert "no such site up with a data store" in refused(
        capsys, "backup", "fetch", "--from", "nowhere", "--etcd", etcd.url, *d
    )
    monkeypatch.delenv("CPN_TOKEN")
    assert "needs an admin token in $CPN_TOKEN" in refused(
        capsys, "backup", "ls", "--from", "http://127.0.0.1:9", *d
    )
    assert "--agent-ca: no such file" in refused(
        capsys, "backup", "ls", "--sites", "--etcd", etcd.url, "--agent-ca", "/none", *d
    )


def test_recovery_of_a_registry_never_restored(
    etcd: EmbeddedEtcd, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "recovery", "--etcd", etcd.url)
    assert code == 0 and "was not restored" in out


@pytest.mark.e2e
def test_a_secure_etcd_is_backed_up_as_root_only_and_verified(
    secure: SecureEtcd,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """etcd lets only its root role snapshot: the broker's user is refused (the leader says so,
    broker.leader.backups), root's credentials back up, and verify and restore read the
    backup (auth on) through a scratch etcd as root."""

    async def as_broker() -> None:
        async with secure.registry(BROKER_USER) as broker:
            await BackupStore(tmp_path / "refused").take(broker, now=time.time())

    with pytest.raises(PermissionDenied, match="only its root role take snapshots"):
        asyncio.run(as_broker())
    creds = str(secure.credentials(ROOT_USER))
    where = str(tmp_path / "b")
    code, _, err = run(capsys, "backup", "create", "--etcd-credentials", creds, "--dir", where)
    assert code == 0, err
    code, out, err = run(capsys, "backup", "verify", "--dir", where)
    assert code == 0 and "restored and read back" in out, err
    name = BackupStore(Path(where)).backups()[-1].name
    data = str(tmp_path / "restored")
    code, out, err = run(capsys, "restore", name, "--dir", where, "--data-dir", data)
    assert code == 0, err
