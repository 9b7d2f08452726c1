"""`cpn backup create|ls|fetch|verify|key`, `cpn restore SNAPSHOT`, `cpn recovery`: the
registry's backups and their copies at the sites, a registry rebuilt from one, and what became
of the runs it did not know (cpn.backup, cpn.backup_remote, sites.registry.backups,
docs/backup.md).

A bad snapshot, a damaged one, a data directory that exists, a site that refuses (no such
backup there, a token that may not read it) exits 2 with one line; an unreachable registry or
agent exits 1; a backup taken whose copy failed at a site chosen for one exits 3 (fewer sites
up with a data store than --copies is a warning only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from broker.ops.backup_copies import CopyError, CopyPlan, Remote, copy_out, fetch, listing
from cpn.backup import DEFAULT_COLLECT_S, Member, parse_member, restore, verify
from cpn.backup_remote import agent_session, is_url, readers_of, remote_by_url, shelves_of
from cpn.cli_base import CliParser, UsageError, etcd_access, registry_of
from sites.kits.clock import SystemClock
from sites.kits.sealed import load_key, new_key
from sites.model import keys
from sites.model.errors import RegistryUnavailable
from sites.model.recovery import Fate, Phase, Recovery
from sites.registry.backups import BackupInfo, BackupStore, check_backup_name
from sites.registry.client import Registry

__all__ = ["add_parsers"]

BACKUP_DIR_ENV = "CPN_BACKUP_DIR"


def _backup_dir(args: argparse.Namespace) -> Path:
    given = args.dir or os.environ.get(BACKUP_DIR_ENV)
    if given:
        return Path(given)
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "cpn" / "backups"


def _when(at: float | None) -> str:
    if at is None:
        return "-"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _snapshot_path(args: argparse.Namespace) -> Path:
    """A file path as given, else a backup's name in --dir (none: the newest there)."""
    if args.snapshot is None:
        store = BackupStore(_backup_dir(args))
        newest = store.backups()
        if not newest:
            raise UsageError(f"no backup in {store.directory} (--dir)")
        return store.path(newest[-1].name)
    given = Path(args.snapshot)
    if given.suffix == ".db" or given.exists() or "/" in args.snapshot:
        return given
    return BackupStore(_backup_dir(args)).path(args.snapshot)


async def cmd_backup_create(args: argparse.Namespace) -> int:
    if args.copies < 0:
        raise UsageError(f"--copies: must be >= 0, got {args.copies}")
    store = BackupStore(_backup_dir(args), keep=args.keep)
    before = {i.name: i.copies for i in store.backups()}
    failed: dict[str, str] = {}
    async with registry_of(args) as registry:
        info = await store.take(registry, now=time.time())
        if args.copies > 0:
            kept = {i.name for i in store.backups()}
            plan = CopyPlan(
                copies=args.copies, prefer_regions=tuple(args.prefer_region),
                home_region=args.home_region, keep=args.keep, key=_key(args),
            )  # fmt: skip
            candidates, readers = await shelves_of(registry), await readers_of(registry)
            async with agent_session(args.agent_ca) as http:
                outcome = await copy_out(
                    http, store, info, candidates=candidates, plan=plan, readers=readers,
                    clock=SystemClock(), sub="operator",
                    pruned={n: c for n, c in before.items() if n not in kept and c},
                )  # fmt: skip
            info, failed = store.get(info.name), outcome.failed
            if outcome.short:
                print(f"cpn: warning: backup {info.name}: {outcome.short}", file=sys.stderr)
    if args.output == "json":
        print(json.dumps({**info.to_dict(), "failed": failed}, indent=1, sort_keys=True))
    else:
        print(
            f"backup {info.name}: revision {info.revision}, {info.size_bytes:,} bytes from "
            f"{info.member}, at {store.path(info.name)}"
        )
        if args.copies > 0:
            print(f"copies (sha256 checked there): {', '.join(info.copies) or 'none'}")
    for site, why in failed.items():
        print(f"cpn: warning: no copy at {site}: {why}", file=sys.stderr)
    return 3 if failed else 0


def _key(args: argparse.Namespace) -> bytes | None:
    return load_key(Path(args.key)) if args.key else None


def cmd_backup_key(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if path.exists():
        raise UsageError(f"{path} exists: a key is never overwritten (the copies need it)")
    new_key(path)
    print(
        f"backup key at {path} (0600): give it as backup.key_file (configs/broker.yaml) or "
        "--key; keep a copy off the broker's host, beside the admin token: without it the "
        "sealed copies at the sites cannot be opened"
    )
    return 0


def _where(info: BackupInfo) -> str:
    return ", ".join(("local", *info.copies))


async def cmd_backup_ls(args: argparse.Namespace) -> int:
    if args.source is not None or args.sites:
        return await _cmd_backup_ls_remote(args)
    backups = BackupStore(_backup_dir(args)).backups()
    if args.output == "json":
        print(json.dumps([i.to_dict() for i in backups], indent=1))
        return 0
    print(f"{'NAME':<26} {'TAKEN':<24} {'REVISION':>9} {'BYTES':>12}  COPIES")
    for i in backups:
        print(
            f"{i.name:<26} {_when(i.taken_at):<24} {i.revision:>9} {i.size_bytes:>12,}  {_where(i)}"
        )
    return 0


async def _remotes(args: argparse.Namespace) -> list[Remote]:
    """--from's agent (by URL: the admin token), or the site's (through the registry: a grant),
    or every site's that may hold copies now."""
    if args.source and is_url(args.source):
        return [remote_by_url(args.source)]
    async with registry_of(args) as registry:
        candidates = await shelves_of(registry)
    if args.source:
        candidates = [s for s in candidates if s.site == args.source]
        if not candidates:
            raise UsageError(
                f"--from {args.source}: no such site up with a data store now (give its "
                "agent's URL instead, with an admin token in $CPN_TOKEN)"
            )
    clock = SystemClock()
    return [s.remote(clock, "read", "operator") for s in candidates]


def _refused(exc: CopyError) -> int:
    """A site's refusal is the caller's (exit 2); one that cannot be reached is not (1)."""
    if 400 <= exc.status < 500:
        raise UsageError(str(exc)) from None
    print(f"cpn: error: {exc}", file=sys.stderr)
    return 1


async def _cmd_backup_ls_remote(args: argparse.Namespace) -> int:
    rows: list[tuple[str, BackupInfo]] = []
    async with agent_session(args.agent_ca) as http:
        for remote in await _remotes(args):
            try:
                rows += [(remote.where, i) for i in await listing(http, remote)]
            except CopyError as exc:
                if args.source:
                    return _refused(exc)
                print(f"cpn: warning: {exc}", file=sys.stderr)
    if args.output == "json":
        print(json.dumps([{**i.to_dict(), "site": w} for w, i in rows], indent=1))
        return 0
    print(f"{'SITE':<20} {'NAME':<26} {'TAKEN':<24} {'REVISION':>9} {'BYTES':>12}")
    for w, i in sorted(rows, key=lambda r: (r[1].taken_at, r[0])):
        print(f"{w:<20} {i.name:<26} {_when(i.taken_at):<24} {i.revision:>9} {i.size_bytes:>12,}")
    return 0


async def cmd_backup_fetch(args: argparse.Namespace) -> int:
    if args.name is not None:
        check_backup_name(args.name)
    store = BackupStore(_backup_dir(args))
    last: CopyError | None = None
    async with agent_session(args.agent_ca) as http:
        for remote in await _remotes(args):
            try:
                name = args.name
                if name is None:
                    held = await listing(http, remote)
                    if not held:
                        raise CopyError(remote.where, "holds no backup", 404)
                    name = held[-1].name
                if store.info_path(name).exists():
                    raise UsageError(f"{name} is in {store.directory} already (--dir)")
                info = await fetch(http, remote, name, store, _key(args))
            except CopyError as exc:
                last = exc
                continue
            info = store.record_copies(info.name, (remote.where,))
            if args.output == "json":
                print(json.dumps({**info.to_dict(), "path": str(store.path(info.name))}))
                return 0
            print(
                f"fetched {info.name} (taken {_when(info.taken_at)}, revision {info.revision}) "
                f"from {remote.where}: {info.size_bytes:,} bytes, sha256 checked, at "
                f"{store.path(info.name)}"
            )
            print(
                f"next: cpn backup verify {info.name} --dir {store.directory}; then cpn "
                f"restore {info.name} --dir {store.directory} --data-dir DIR (docs/backup.md)"
            )
            return 0
    if last is None:
        raise UsageError("no site is up with a data store to fetch from (--from)")
    return _refused(last)


async def cmd_backup_verify(args: argparse.Namespace) -> int:
    result = await verify(_snapshot_path(args))
    if args.output == "json":
        print(
            json.dumps(
                {
                    "path": str(result.path),
                    "revision": result.status.revision,
                    "hash": result.status.hash,
                    "keys": result.keys,
                    "sites": result.sites,
                    "jobs": result.jobs,
                    "described": result.info is not None,
                },
                indent=1,
            )
        )
        return 0
    checked = "size and sha256 match its description; " if result.info else ""
    print(
        f"{result.path}: ok: {checked}etcd hash {result.status.hash:08x}, revision "
        f"{result.status.revision}; restored and read back: {result.keys} keys, "
        f"{result.sites} sites, {result.jobs} unfinished jobs"
    )
    return 0


async def cmd_restore(args: argparse.Namespace) -> int:
    members = [parse_member(m) for m in args.member] or [Member("cpn", "http://127.0.0.1:2380")]
    if len(members) == 2:
        raise UsageError(
            "--member: a registry of two members has no quorum if one fails; give "
            "one or three (or more)"
        )
    if args.collect_s <= 0:
        raise UsageError(f"--collect-s: must be > 0, got {args.collect_s}")
    if args.wait < 0:
        raise UsageError(f"--wait: must be >= 0, got {args.wait}")
    if args.wait > 0:
        etcd_access(args)  # where to wait, known before anything is written
    data_dir = Path(args.data_dir)
    out = await restore(
        _snapshot_path(args), data_dir, members, now=time.time(), collect_s=args.collect_s
    )
    rec = out.recovery
    print(
        f"restored {rec.snapshot} (revision {rec.snapshot_revision}, taken "
        f"{_when(rec.snapshot_taken_at)}) into {len(members)} member(s); restore "
        f"{rec.generation}"
    )
    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for m, d in zip(members, out.data_dirs, strict=True):
        print(
            f"  start: etcd --name {m.name} --data-dir {d} --initial-cluster {cluster} "
            f"--initial-advertise-peer-urls {m.peer_url} --listen-peer-urls {m.peer_url} "
            "--listen-client-urls URL --advertise-client-urls URL"
        )
    print(
        f"the snapshot knows {len(rec.sites)} site(s) and {out.jobs_live} unfinished job(s). "
        f"Once etcd is up, agents report their runs again and the leader broker decides "
        f"each (at most {rec.collect_s:g} s for silent sites): "
        + (
            f"waiting up to {args.wait:g} s for them (start the members now)"
            if args.wait > 0
            else "`cpn recovery --wait` prints what was adopted, recovered, stopped and lost"
        ),
        flush=True,
    )
    if args.wait <= 0:
        return 0
    args.output = "table"
    return _print_recovery(args, await _read_recovery(args, generation=rec.generation))


async def _read_recovery(
    args: argparse.Namespace, *, generation: str | None = None
) -> Recovery | None:
    """The registry's Recovery, waiting up to `--wait` s for it to be done; with the restore's
    `generation`, for the registry to come up with it first (its members are being started
    beside `cpn restore --wait`)."""
    deadline = time.monotonic() + args.wait
    while True:
        try:
            async with registry_of(args) as registry:
                return await _poll_recovery(registry, deadline, generation)
        except RegistryUnavailable:
            if generation is None or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)  # its members are still starting


async def _poll_recovery(
    registry: Registry, deadline: float, generation: str | None
) -> Recovery | None:
    while True:
        got = await registry.get_raw(keys.RECOVERY)
        rec = Recovery.model_validate_json(got[0]) if got is not None else None
        late = time.monotonic() >= deadline
        if generation is not None and (rec is None or rec.generation != generation):
            if late:
                return rec
            await asyncio.sleep(0.5)  # not the restored registry yet
            continue
        if rec is None or rec.phase is Phase.done or late:
            return rec
        await asyncio.sleep(0.5)


async def cmd_recovery(args: argparse.Namespace) -> int:
    return _print_recovery(args, await _read_recovery(args))


def _print_recovery(args: argparse.Namespace, rec: Recovery | None) -> int:
    if rec is None:
        print("the registry was not restored from a backup")
        return 0
    if args.output == "json":
        print(rec.model_dump_json(indent=1))
        return 0 if rec.phase is Phase.done else 3
    counts = ", ".join(f"{n} {fate}" for fate, n in rec.counts.items())
    print(
        f"restore {rec.generation} of {rec.snapshot} (revision {rec.snapshot_revision}): "
        f"{rec.phase.value}; {len(rec.reported)}/{len(rec.sites)} sites reported"
        + (f"; settled: {counts}" if counts else "")
    )
    for fate in Fate:
        jobs = rec.fated(fate)
        if not jobs:
            continue
        print(f"{fate.value}: {len(jobs)}")
        for j in jobs:
            where = f" at {j.site}" if j.site else ""
            print(f"  {j.job}{where}: {j.reason}")
    if rec.phase is not Phase.done:
        print("still collecting: the lists above are not final")
        return 3
    return 0


def add_parsers(
    add: Callable[..., argparse.ArgumentParser],
    etcd_arg: Callable[[argparse.ArgumentParser], None],
) -> None:
    """`cpn backup ...`, `cpn restore`, `cpn recovery`, added with cpn.cli's `add`."""

    def dir_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--dir",
            metavar="DIR",
            help=f"backup directory (default: ${BACKUP_DIR_ENV}, else ~/.local/state/cpn/backups)",
        )
        p.add_argument("-o", "--output", choices=("table", "json"), default="table")

    def from_arg(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument(
            "--from",
            dest="source",
            metavar="SITE|URL",
            help=f"{what}: a site's id (through etcd), or its agent's URL with an admin token "
            "in $CPN_TOKEN (when etcd is gone)",
        )

    def agent_ca_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--agent-ca", metavar="FILE", help="the CA the agents' https:// URLs are checked with"
        )

    def key_arg(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--key", metavar="FILE", help=f"{what} (`cpn backup key FILE`)")

    backup = add("backup", help="snapshots of the registry (docs/backup.md)")
    sub = backup.add_subparsers(dest="backup_command", required=True, parser_class=CliParser)
    create = sub.add_parser("create", help="take a snapshot of etcd now")
    etcd_arg(create)
    dir_arg(create)
    create.add_argument(
        "--keep",
        type=int,
        default=0,
        metavar="N",
        help="then keep only the newest N backups, here and at each site (default: all)",
    )
    create.add_argument(
        "--copies",
        type=int,
        default=2,
        metavar="N",
        help="put it at N sites' data stores too (default 2; 0: none)",
    )
    create.add_argument(
        "--prefer-region",
        action="append",
        default=[],
        metavar="REGION",
        help="copies to sites of this region first (repeat: in order)",
    )
    create.add_argument(
        "--home-region", metavar="REGION", help="this host's region: its sites last"
    )
    agent_ca_arg(create)
    key_arg(create, "seal the copies at the sites with this key")
    create.set_defaults(func=cmd_backup_create)
    ls = sub.add_parser("ls", help="the backups and where their copies are, oldest first")
    dir_arg(ls)
    etcd_arg(ls)
    from_arg(ls, "list the backups a site holds instead")
    ls.add_argument(
        "--sites", action="store_true", help="list what every site up holds (through etcd)"
    )
    agent_ca_arg(ls)
    ls.set_defaults(func=cmd_backup_ls)
    get = sub.add_parser("fetch", help="bring a backup back from a site, checked by sha256")
    get.add_argument("name", metavar="NAME", nargs="?", help="default: the site's newest")
    dir_arg(get)
    etcd_arg(get)
    from_arg(get, "fetch from this site (default: the first that holds it)")
    agent_ca_arg(get)
    key_arg(get, "open a sealed copy with this key")
    get.set_defaults(func=cmd_backup_fetch)
    key = sub.add_parser("key", help="make a key to seal the copies at the sites with")
    key.add_argument("file", metavar="FILE")
    key.set_defaults(func=cmd_backup_key)
    check = sub.add_parser("verify", help="restore a backup into a scratch etcd and read it back")
    check.add_argument("snapshot", metavar="NAME|FILE", nargs="?", help="default: the newest")
    dir_arg(check)
    check.set_defaults(func=cmd_backup_verify)

    rest = add("restore", help="rebuild the registry's members from a backup (docs/backup.md)")
    rest.add_argument("snapshot", metavar="NAME|FILE")
    rest.add_argument(
        "--data-dir",
        required=True,
        metavar="DIR",
        help="each member's data directory is made here, named as the member",
    )
    rest.add_argument(
        "--member",
        action="append",
        default=[],
        metavar="NAME=PEER_URL",
        help="a member of the rebuilt registry (repeat for three; default: one, "
        "cpn=http://127.0.0.1:2380)",
    )
    rest.add_argument(
        "--collect-s",
        type=float,
        default=DEFAULT_COLLECT_S,
        metavar="S",
        help="how long the leader broker waits for agents that do not report",
    )
    rest.add_argument("--dir", metavar="DIR", help="backup directory a NAME is looked up in")
    rest.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="then wait up to S seconds for the rebuilt registry (at --etcd; start its "
        "members meanwhile) to come up and the leader to decide every run, and print what was "
        "adopted, recovered, stopped and lost, as `cpn recovery` does",
    )
    etcd_arg(rest)
    rest.set_defaults(func=cmd_restore)

    rec = add("recovery", help="what the last restore adopted, recovered, stopped and lost")
    etcd_arg(rec)
    rec.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the leader to finish deciding",
    )
    rec.add_argument("-o", "--output", choices=("table", "json"), default="table")
    rec.set_defaults(func=cmd_recovery)
