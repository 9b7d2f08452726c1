"""`cpn data put|ls|describe|rm|replicate|share|get`: datasets (docs/data.md) through the broker's
/v1/datasets API.

A dataset is named `[OWNER/]NAME[@VERSION]`; without OWNER, the token's own tenant (asked of
/v1/whoami). `put` hashes the files here first (a progress line on stderr), begins the upload,
sends each file (streamed from disk) and commits: only the commit registers a version, so an
interrupted put (Ctrl-C included) leaves nothing registered. `get` checks every file's sha256
against the version's manifest as it is written, and keeps nothing that does not match.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from cpn import render
from cpn.cli_base import BrokerArg, CliParser, UsageError
from cpn.client import ApiError, BrokerClient
from cpn.render import size
from sites.model.data import MAX_FILES, clean_path, parse_ref

__all__ = ["add_parsers", "cmd_data"]

CHUNK = 1024 * 1024


class Progress:
    """One line on stderr, rewritten in place, at most every 0.2 s (a terminal only)."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self._shown = 0.0
        self._tty = sys.stderr.isatty()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty and now - self._shown >= 0.2:
            self._shown = now
            line = f"\r{self.what} {size(self.done)} / {size(self.total)}"
            print(line, end="", file=sys.stderr)

    def end(self) -> None:
        if self._tty:
            print(f"\r{self.what} {size(self.done)} / {size(self.total)}", file=sys.stderr)


def _walk(root: Path) -> list[tuple[str, Path]]:
    """(relative path, file) of every regular file under `root` (or `root` itself), sorted."""
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise UsageError(f"{root}: no such file or directory")
    out = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        try:
            clean_path(rel)
        except ValueError as exc:
            raise UsageError(f"{path}: {exc}") from None
        out.append((rel, path))
    if not out:
        raise UsageError(f"{root}: no files to put")
    if len(out) > MAX_FILES:
        raise UsageError(f"{root}: {len(out)} files, over {MAX_FILES}: pack it (tar) first")
    return out


def _hash(files: list[tuple[str, Path]]) -> dict[str, Any]:
    total = sum(p.stat().st_size for _, p in files)
    progress = Progress("hashing", total)
    entries = []
    for rel, path in files:
        digest = hashlib.sha256()
        size = 0
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                progress.add(len(chunk))
        entries.append({"path": rel, "size": size, "sha256": digest.hexdigest()})
    progress.end()
    return {"files": entries}


async def _owner_of(client: BrokerClient, given: str) -> str:
    """`given` as 'owner/name[@v]': the token's tenant when it names no owner."""
    if "/" in given.partition("@")[0]:
        return given
    me = await client.call("GET", "/v1/whoami")
    if not me.get("tenant"):
        raise UsageError(f"name the owner: OWNER/{given} (this token is not a tenant's)")
    return f"{me['tenant']}/{given}"


async def _ref(client: BrokerClient, given: str) -> tuple[str, str, int | None]:
    try:
        return parse_ref(await _owner_of(client, given))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


async def _file_body(path: Path, progress: Progress) -> AsyncIterator[bytes]:
    with path.open("rb") as f:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            progress.add(len(chunk))
            yield chunk


def _error(status: int, raw: bytes) -> ApiError:
    try:
        err = json.loads(raw)["error"]
        return ApiError(status, str(err["message"]), err.get("field"))
    except (ValueError, KeyError, TypeError):
        return ApiError(status, raw.decode(errors="replace")[:300] or f"HTTP {status}")


def _check(args: argparse.Namespace) -> None:
    """What the arguments alone say is wrong (exit 2 before any call)."""
    if args.data_command == "put" and args.site and args.region:
        raise UsageError("--site or --region, not both")
    if args.data_command == "replicate" and bool(args.to) == bool(args.region):
        raise UsageError("--to SITE or --region REGION (one of them)")
    if args.data_command == "put" and not Path(args.path).exists():
        raise UsageError(f"{args.path}: no such file or directory")


async def cmd_put(args: argparse.Namespace, client: BrokerClient) -> int:
    owner, name, version = await _ref(client, args.name)
    if version is not None:
        raise UsageError(f"{args.name}: put makes the next version; name no @VERSION")
    files = _walk(Path(args.path))
    manifest = _hash(files)
    base = f"/v1/datasets/{owner}/{name}"
    body: dict[str, Any] = {"manifest": manifest}
    for key in ("site", "region", "description"):
        if getattr(args, key):
            body[key] = getattr(args, key)
    began = await client.call("POST", f"{base}/uploads", body)
    progress = Progress(f"uploading to {began['site']}", int(began["bytes"]))
    session = client.session
    for rel, path in files:
        url = f"{client.url}{base}/uploads/{began['upload']}/files/{quote(rel)}"
        headers = {"Content-Type": "application/octet-stream",
                   "Content-Length": str(path.stat().st_size)}  # fmt: skip
        try:
            async with session.put(url, data=_file_body(path, progress), headers=headers) as r:
                if r.status >= 300:
                    raise _error(r.status, await r.read())
        except aiohttp.ClientError as exc:
            raise ApiError(0, f"broker at {client.url} is unreachable: {exc}") from exc
    progress.end()
    made = await client.call(
        "POST", f"{base}/uploads/{began['upload']}/commit", {"manifest": manifest}
    )
    if args.output == "json":
        print(json.dumps(made, indent=2))
    else:
        print(f"{made['tenant']}/{made['name']}@{made['version']}  {size(made['bytes'])} in "
              f"{made['files']} files at {made['home']}")  # fmt: skip
    return 0


async def cmd_ls(args: argparse.Namespace, client: BrokerClient) -> int:
    rows: list[dict[str, Any]] = []
    async for items in client.pages("/v1/datasets", {}, limit=None):
        rows += items
    if args.output == "json":
        print(json.dumps(rows, indent=2))
        return 0
    now = time.time()
    print(
        render.table(
            ("DATASET", "LATEST", "SHARED WITH", "UPDATED", "DESCRIPTION"),
            [
                (
                    f"{r['tenant']}/{r['name']}",
                    str(r["latest"]),
                    ",".join(r["shared_with"]) or "-",
                    render.ago(now - r["updated_at"]),
                    r["description"],
                )  # fmt: skip
                for r in rows
            ],
        )
    )
    return 0


async def cmd_describe(args: argparse.Namespace, client: BrokerClient) -> int:
    owner, name, version = await _ref(client, args.name)
    info = await client.call("GET", f"/v1/datasets/{owner}/{name}")
    versions = [v for v in info["versions"] if version is None or v["version"] == version]
    if version is not None and not versions:
        raise ApiError(404, f"no version {version} of dataset {owner}/{name}")
    if args.output == "json":
        print(json.dumps({**info, "versions": versions}, indent=2))
        return 0
    print(f"dataset     {owner}/{name}")
    print(f"latest      {info['latest']}")
    print(f"shared with {', '.join(info['shared_with']) or '-'}")
    if info["description"]:
        print(f"description {info['description']}")
    now = time.time()
    print(
        render.table(
            ("VERSION", "SIZE", "FILES", "REPLICAS", "MADE", "BY", "DIGEST"),
            [
                (
                    str(v["version"]),
                    size(v["bytes"]),
                    str(v["files"]),
                    ",".join(v["replicas"]) or "-",
                    render.ago(now - v["created_at"]),
                    v["made_by"],
                    v["digest"][:16],
                )  # fmt: skip
                for v in versions
            ],
        )
    )
    return 0


async def cmd_rm(args: argparse.Namespace, client: BrokerClient) -> int:
    owner, name, version = await _ref(client, args.name)
    path = f"/v1/datasets/{owner}/{name}"
    if version is not None:
        path += f"/versions/{version}"
    await client.call("DELETE", path)
    print(f"removed {owner}/{name}" + (f"@{version}" if version is not None else ""))
    return 0


async def cmd_replicate(args: argparse.Namespace, client: BrokerClient) -> int:
    owner, name, version = await _ref(client, args.name)
    body: dict[str, Any] = {"site": args.to} if args.to else {"region": args.region}
    if version is not None:
        body["version"] = version
    started = await client.call("POST", f"/v1/datasets/{owner}/{name}/replicate", body)
    if args.output == "json":
        print(json.dumps(started, indent=2))
    elif started["state"] == "held":
        print(f"{started['dataset']} is held at {started['site']} already")
    else:
        print(f"{started['dataset']} ordered to {started['site']} from "
              f"{', '.join(started['sources']) or '-'}")  # fmt: skip
    return 0


async def cmd_share(args: argparse.Namespace, client: BrokerClient) -> int:
    owner, name, version = await _ref(client, args.name)
    if version is not None:
        raise UsageError("a dataset is shared whole: name no @VERSION")
    body = {"remove" if args.remove else "add": args.tenants}
    meta = await client.call("PUT", f"/v1/datasets/{owner}/{name}/shares", body)
    print(f"{owner}/{name} shared with {', '.join(meta['shared_with']) or 'nobody'}")
    return 0


async def cmd_get(args: argparse.Namespace, client: BrokerClient) -> int:
    owner, name, version = await _ref(client, args.name)
    info = await client.call("GET", f"/v1/datasets/{owner}/{name}")
    number = version or info["latest"]
    chosen = [v for v in info["versions"] if v["version"] == number]
    if not chosen:
        raise ApiError(404, f"no version {number} of dataset {owner}/{name}")
    digest = chosen[0]["digest"]
    # the manifest: its files' sizes and sha256, from the broker's copy
    manifest = await client.call("GET", f"/v1/datasets/{owner}/{name}/versions/{number}/manifest")
    dest = Path(args.dest)
    progress = Progress("downloading", int(chosen[0]["bytes"]))
    session = client.session
    for entry in manifest["files"]:
        rel = clean_path(entry["path"])
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".{target.name}.part")
        url = f"{client.url}/v1/datasets/{owner}/{name}/versions/{number}/files/{quote(rel)}"
        sha = hashlib.sha256()
        try:
            async with session.get(url) as r:
                if r.status >= 300:
                    raise _error(r.status, await r.read())
                with part.open("wb") as f:
                    async for chunk in r.content.iter_chunked(CHUNK):
                        sha.update(chunk)
                        await asyncio.to_thread(f.write, chunk)
                        progress.add(len(chunk))
        except aiohttp.ClientError as exc:
            part.unlink(missing_ok=True)
            raise ApiError(0, f"broker at {client.url} is unreachable: {exc}") from exc
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        if sha.hexdigest() != entry["sha256"]:
            part.unlink(missing_ok=True)
            raise ApiError(0, f"{rel}: checksum mismatch (got {sha.hexdigest()[:16]}, "
                              f"want {entry['sha256'][:16]}); nothing kept")  # fmt: skip
        os.replace(part, target)
    progress.end()
    print(f"{owner}/{name}@{number} ({digest[:16]}): {len(manifest['files'])} files in {dest}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, BrokerClient], Any]] = {
    "put": cmd_put,
    "ls": cmd_ls,
    "describe": cmd_describe,
    "rm": cmd_rm,
    "replicate": cmd_replicate,
    "share": cmd_share,
    "get": cmd_get,
}


async def cmd_data(args: argparse.Namespace) -> int:
    _check(args)
    async with BrokerClient.to(args.broker) as client:
        result: int = await COMMANDS[args.data_command](args, client)
        return result


def add_parsers(add: Callable[..., argparse.ArgumentParser], broker_arg: BrokerArg) -> None:
    """`cpn data ...`, added with cpn.cli's `add` and `broker_arg`."""
    data = add("data", help="datasets: put, list, describe, remove, replicate, share, get "
               "(docs/data.md)")  # fmt: skip
    sub = data.add_subparsers(dest="data_command", required=True, parser_class=CliParser)
    ref = "[OWNER/]NAME[@VERSION] (default owner: the token's tenant; version: the latest)"

    put = sub.add_parser("put", help="put a file or a directory as the next version")
    put.add_argument("name", metavar="NAME", help="[OWNER/]NAME")
    put.add_argument("path", metavar="PATH")
    put.add_argument("--site", help="store it at this site")
    put.add_argument("--region", help="store it at a live site of this region")
    put.add_argument("--description", help="the dataset's description")
    broker_arg(put)

    ls = sub.add_parser("ls", help="datasets: your own and those shared with you")
    broker_arg(ls)

    describe = sub.add_parser("describe", help="a dataset's versions, sizes and replicas")
    describe.add_argument("name", metavar="NAME", help=ref)
    broker_arg(describe)

    rm = sub.add_parser("rm", help="remove a version, or the whole dataset")
    rm.add_argument("name", metavar="NAME", help=ref + "; no @VERSION: every version")
    broker_arg(rm)

    replicate = sub.add_parser("replicate", help="keep a version at a site or in a region")
    replicate.add_argument("name", metavar="NAME", help=ref)
    replicate.add_argument("--to", metavar="SITE", help="this site")
    replicate.add_argument("--region", help="the best site of this region")
    broker_arg(replicate)

    share = sub.add_parser("share", help="let tenants read and use a dataset (or stop)")
    share.add_argument("name", metavar="NAME", help="[OWNER/]NAME")
    share.add_argument("tenants", metavar="TENANT", nargs="+")
    share.add_argument("--remove", action="store_true", help="stop sharing with them")
    broker_arg(share)

    get = sub.add_parser("get", help="download a version, every file checked")
    get.add_argument("name", metavar="NAME", help=ref)
    get.add_argument("dest", metavar="DEST", help="the directory to write it into")
    broker_arg(get)
    data.set_defaults(func=cmd_data)
