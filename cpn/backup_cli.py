"""`cpn backup create|ls|verify`, `cpn restore SNAPSHOT`, `cpn recovery`: the registry's
backups, a registry rebuilt from one, and what became of the runs it did not know
(cpn.backup, sites.registry.backups, docs/backup.md).

A bad snapshot, a damaged one or a data directory that exists exits 2 with one line; an
unreachable registry exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from cpn.backup import DEFAULT_COLLECT_S, Member, parse_member, restore, verify
from cpn.cli_base import CliParser, UsageError, registry_of
from sites.model import keys
from sites.model.recovery import Fate, Phase, Recovery
from sites.registry.backups import BackupStore

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
    store = BackupStore(_backup_dir(args), keep=args.keep)
    async with registry_of(args) as registry:
        info = await store.take(registry, now=time.time())
    if args.output == "json":
        print(info.to_json())
    else:
        print(
            f"backup {info.name}: revision {info.revision}, {info.size_bytes:,} bytes from "
            f"{info.member}, at {store.path(info.name)}"
        )
    return 0


def cmd_backup_ls(args: argparse.Namespace) -> int:
    backups = BackupStore(_backup_dir(args)).backups()
    if args.output == "json":
        print(json.dumps([json.loads(i.to_json()) for i in backups], indent=1))
        return 0
    print(f"{'NAME':<26} {'TAKEN':<24} {'REVISION':>9} {'BYTES':>12}")
    for i in backups:
        print(f"{i.name:<26} {_when(i.taken_at):<24} {i.revision:>9} {i.size_bytes:>12,}")
    return 0


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
        f"each (at most {rec.collect_s:g} s for silent sites): `cpn recovery --wait` prints "
        "what was adopted, recovered, stopped and lost"
    )
    return 0


async def _read_recovery(args: argparse.Namespace) -> Recovery | None:
    async with registry_of(args) as registry:
        deadline = time.monotonic() + args.wait
        while True:
            got = await registry.get_raw(keys.RECOVERY)
            rec = Recovery.model_validate_json(got[0]) if got is not None else None
            if rec is None or rec.phase is Phase.done or time.monotonic() >= deadline:
                return rec
            await asyncio.sleep(0.5)


async def cmd_recovery(args: argparse.Namespace) -> int:
    rec = await _read_recovery(args)
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
        help="then keep only the newest N backups (default: all)",
    )
    create.set_defaults(func=cmd_backup_create)
    ls = sub.add_parser("ls", help="the backups in the directory, oldest first")
    dir_arg(ls)
    ls.set_defaults(func=cmd_backup_ls)
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
