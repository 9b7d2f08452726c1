"""Which unprivileged account runs a tenant's jobs at a site (long form: docs/security.md).

An agent that is root never runs a job as itself: each tenant maps to an account of its own,
named in the site file (`executor.confinement.accounts.tenants`, checked at start) or given
a uid from `accounts.uid_range` the first time the tenant runs here. The ids handed out are
kept in ``tenant-ids.json`` beside the site's work dir, written under an exclusive lock (the
agents of a demo federation share a host and so its uids), so a tenant keeps its uid across
restarts and two tenants never share one. An agent that is not root runs jobs as its own uid;
the sandbox (sites.executors.sandbox) is then what keeps them from its files.
"""

from __future__ import annotations

import fcntl
import grp
import hashlib
import json
import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from sites.model.errors import ConfigError, Problem, SitesError
from sites.model.spec import Accounts

__all__ = ["Account", "AccountError", "TenantAccounts", "check_named"]

IDS_FILE = "tenant-ids.json"


class AccountError(SitesError):
    """A tenant has no account at this site (no named account and no uid range)."""


@dataclass(frozen=True)
class Account:
    """The identity a run gets: ``name`` is the passwd name when there is one."""

    uid: int
    gid: int
    name: str


def _bad(field: str, reason: str) -> ConfigError:
    source, _, path = field.partition(":")
    return ConfigError([Problem(source=source, field=path, reason=reason)])


def check_named(accounts: Accounts, *, field: str) -> dict[str, Account]:
    """The named accounts, looked up; ConfigError naming the entry when one is unusable.
    ``field`` is "<source>:<dotted path>" (the site, and where its confinement's accounts are)."""
    found: dict[str, Account] = {}
    agent_uid = os.getuid()
    for tenant, user in sorted(accounts.tenants.items()):
        where = f"{field}.tenants.{tenant}"
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise _bad(where, f"no account {user!r} on this host") from None
        if entry.pw_uid == 0 or entry.pw_uid == agent_uid or entry.pw_gid == 0:
            raise _bad(where, f"{user!r} is root or the agent's account, not a tenant's own")
        if _privileged_groups(user):
            raise _bad(where, f"{user!r} is in a privileged group (root, sudo, ...)")
        found[tenant] = Account(uid=entry.pw_uid, gid=entry.pw_gid, name=user)
    owners: dict[int, str] = {}
    for tenant, account in found.items():
        other = owners.setdefault(account.uid, tenant)
        if other != tenant:
            raise _bad(f"{field}.tenants", f"{other} and {tenant} share uid {account.uid}")
    return found


_PRIVILEGED = ("root", "sudo", "wheel", "adm", "shadow", "disk", "docker", "lxd", "kvm")


def _privileged_groups(user: str) -> list[str]:
    names = []
    for name in _PRIVILEGED:
        try:
            if user in grp.getgrnam(name).gr_mem:
                names.append(name)
        except KeyError:
            continue
    return names


class TenantAccounts:
    """tenant -> Account at this site; uids from the range are kept in ``ids_path``."""

    def __init__(self, accounts: Accounts, *, ids_path: Path, field: str) -> None:
        self.settings = accounts
        self.ids_path = ids_path
        self.root = os.geteuid() == 0
        self.named = check_named(accounts, field=field) if self.root else {}
        self._cache: dict[str, Account] = dict(self.named)
        if self.root and accounts.uid_range is not None:
            self._check_range(accounts.uid_range, field)

    def _check_range(self, uid_range: tuple[int, int], field: str) -> None:
        first, last = uid_range
        for entry in pwd.getpwall():
            if first <= entry.pw_uid <= last:
                raise _bad(
                    f"{field}.uid_range",
                    f"uid {entry.pw_uid} ({entry.pw_name}) of this host is in [{first}, {last}]; "
                    "the range must be free",
                )

    def for_tenant(self, tenant: str) -> Account:
        """The account of ``tenant``; the agent's own when it is not root (the sandbox confines)."""
        if not self.root:
            uid = os.getuid()
            return Account(uid=uid, gid=os.getgid(), name=_name_of(uid))
        account = self._cache.get(tenant)
        if account is None:
            account = self._allocate(tenant)
            self._cache[tenant] = account
        return account

    def _allocate(self, tenant: str) -> Account:
        uid_range = self.settings.uid_range
        if uid_range is None:
            raise AccountError(
                f"tenant {tenant!r} has no account at this site "
                "(executor.confinement.accounts: not in `tenants`, and no uid_range)"
            )
        first, last = uid_range
        self.ids_path.parent.mkdir(parents=True, exist_ok=True)
        # a lock file apart from the ids, which are replaced whole (a lock on a replaced
        # inode would let a waiter read what it held before)
        lock_fd = os.open(self.ids_path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                ids: dict[str, int] = json.loads(self.ids_path.read_text())
            except FileNotFoundError:
                ids = {}
            uid = ids.get(tenant)
            if uid is None or not first <= uid <= last:
                uid = _free_uid(tenant, first, last, set(ids.values()))
                ids[tenant] = uid
                tmp = self.ids_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(ids, indent=1, sort_keys=True))
                os.chmod(tmp, 0o600)
                tmp.replace(self.ids_path)
        finally:
            os.close(lock_fd)  # releases the lock
        return Account(uid=uid, gid=uid, name=f"cpn-{tenant}"[:32])


def _free_uid(tenant: str, first: int, last: int, taken: set[int]) -> int:
    """A stable first guess per tenant (so ids rarely move), then the next free id."""
    size = last - first + 1
    start = int.from_bytes(hashlib.sha256(tenant.encode()).digest()[:8], "big") % size
    for i in range(min(size, len(taken) + 1)):
        uid = first + (start + i) % size
        if uid not in taken:
            return uid
    raise AccountError(f"uid_range [{first}, {last}] is used up")


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
