"""The registry's backups a site keeps for the federation: `<store root>/backups/`, served
under /data/backups on the agent's endpoint (docs/backup.md, "Copies at the sites").

The leader broker (and `cpn backup create`) puts each backup it takes at one or more sites'
data stores, so that the broker's host is not the only place a backup lives; the operator
fetches one back (`cpn backup fetch`) onto a new host when that host is lost. A backup holds
the whole registry: it is the federation's, never a tenant's. It is read and written only with

- a broker's grant on `backups:federation` (sites.model.data, signed with this agent's data
  key, which only the brokers and etcd's root read), or
- to read: an admin token of the broker's, checked against the admin tokens' hashes the broker
  hands the site with its copies (`PUT /data/backup-readers`, kept in `readers.json`), so that
  the operator can fetch a backup when no broker and no etcd is left to ask.

A copy is received under a temporary name and kept only once its size and sha256 match the
description the broker sent with it (`X-Cpn-Backup`): sites.registry.backups.BackupStore.adopt.

    GET    /data/backups            the descriptions of the backups held here, oldest first
    GET    /data/backups/{name}     one backup's bytes (X-Cpn-Sha256: the whole file's)
    PUT    /data/backups/{name}     a copy (grant: write); 507 when the store has no room
    DELETE /data/backups/{name}     retention (grant: write)
    PUT    /data/backup-readers     {"tokens": [{"id", "sha256", "expires_at"}]} (grant: write)
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from sites.agent.data.errors import (
    BadInput,
    Forbidden,
    NotHeld,
    StoreFull,
    TooLarge,
    Unauthorized,
    json_list,
)
from sites.agent.data.transfer import GRANT_HEADER, SHA_HEADER
from sites.kits.clock import Clock
from sites.model.data import BACKUPS_SCOPE, Claims, GrantError, Op, allows, verify
from sites.registry.backups import BackupError, BackupInfo, BackupStore, check_backup_name

__all__ = ["INFO_HEADER", "BackupShelf"]

log = logging.getLogger(__name__)

INFO_HEADER = "X-Cpn-Backup"  # a copy's description (BackupInfo as compact JSON)
READERS_FILE = "readers.json"
MAX_READERS = 1000
BODY_CHUNK = 256 * 1024
_TOKEN_RE = re.compile(r"^cpn_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")  # broker.state.auth's
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class BackupShelf:
    """The backups under `directory`; `limit_bytes` is what they may take together (the
    store's limit)."""

    def __init__(
        self, *, directory: Path, site: str, key: str, clock: Clock, limit_bytes: int
    ) -> None:
        # 0700: a job at a site without a sandbox runs on this host, and a backup holds the
        # whole registry (the store's root is 0755 for the objects jobs read)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self.store = BackupStore(directory)
        self.site = site
        self.key = key
        self.clock = clock
        self.limit_bytes = limit_bytes

    # -- who may ------------------------------------------------------------------------------

    def _grant(self, request: web.Request, op: Op) -> Claims:
        token = request.headers.get(GRANT_HEADER)
        if not token:
            raise Unauthorized(f"a broker's grant is needed in {GRANT_HEADER}", "grant")
        try:
            claims = verify(self.key, token, site=self.site, now=self.clock.time())
        except GrantError as exc:
            raise Unauthorized(str(exc), "grant") from exc
        if not allows(claims, BACKUPS_SCOPE, op):
            raise Forbidden(
                f"the grant for {claims.op} on {claims.scope} does not cover the backups",
                "grant",
            )
        return claims

    def _may_read(self, request: web.Request) -> None:
        """A broker's grant, or an admin token the broker told this site of."""
        if request.headers.get(GRANT_HEADER):
            self._grant(request, "read")
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized(
                f"the backups need an admin token (Authorization: Bearer) or a broker's "
                f"grant ({GRANT_HEADER})",
                "Authorization",
            )
        m = _TOKEN_RE.match(token.strip())
        if m is None:
            raise Unauthorized("malformed token", "Authorization")
        token_id, secret = m.groups()
        reader = self._readers().get(token_id)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        if reader is None or not hmac.compare_digest(str(reader.get("sha256")), digest):
            raise Forbidden(
                "only an admin token (as of the broker's last copy here) reads the backups",
                "Authorization",
            )
        expires = reader.get("expires_at")
        if isinstance(expires, (int, float)) and expires <= self.clock.time():
            raise Unauthorized("expired token", "Authorization")

    def _readers(self) -> dict[str, dict[str, Any]]:
        try:
            raw = json.loads((self.store.directory / READERS_FILE).read_bytes())
        except (OSError, ValueError):
            return {}
        tokens = raw.get("tokens") if isinstance(raw, dict) else None
        if not isinstance(tokens, list):
            return {}
        return {str(t["id"]): t for t in tokens if isinstance(t, dict) and "id" in t}

    # -- routes ---------------------------------------------------------------------------------

    async def list_backups(self, request: web.Request) -> web.Response:
        self._may_read(request)
        items = [i.to_dict() for i in self.store.backups()]
        return web.json_response({"site": self.site, "items": items})

    async def get_backup(self, request: web.Request) -> web.StreamResponse:
        self._may_read(request)
        info = self._held(request.match_info["name"])
        return web.FileResponse(
            self.store.path(info.name),
            headers={SHA_HEADER: info.sha256, "Content-Type": "application/octet-stream"},
        )

    async def put_backup(self, request: web.Request) -> web.Response:
        self._grant(request, "write")
        name = _name(request.match_info["name"])
        info = self._description(request, name)
        self.store.prune()  # only the leftovers of copies cut off an hour ago: keep is 0
        held = self.store.bytes_held()
        if held + info.size_bytes > self.limit_bytes:
            raise StoreFull(
                f"backup {name} ({info.size_bytes} bytes) does not fit: the backups here hold "
                f"{held} of the store's {self.limit_bytes}",
                None,
            )
        part = self.store.part_path(name).with_suffix(f".{secrets.token_hex(4)}.part")
        try:
            size = await self._receive(request, part, info.size_bytes)
            await asyncio.to_thread(self.store.adopt, info, part)
        except BackupError as exc:
            raise BadInput(str(exc), "sha256") from exc
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"no room for backup {name}: {exc.strerror}", None) from exc
            raise
        finally:
            part.unlink(missing_ok=True)
        log.info("site %s: keeps backup %s (%d bytes, sha256 checked)", self.site, name, size)
        return web.json_response(
            {"name": name, "bytes": size, "sha256": info.sha256, "site": self.site}, status=201
        )

    async def delete_backup(self, request: web.Request) -> web.Response:
        self._grant(request, "write")
        name = _name(request.match_info["name"])
        if not self.store.remove(name):
            raise NotHeld(f"no backup {name} at {self.site}", "name")
        return web.json_response({"name": name, "removed": True})

    async def put_readers(self, request: web.Request) -> web.Response:
        self._grant(request, "write")
        tokens = await json_list(request, "tokens", MAX_READERS)
        kept = []
        for i, t in enumerate(tokens):
            if not (
                isinstance(t, dict)
                and isinstance(t.get("id"), str)
                and re.fullmatch(r"[0-9a-f]{16}", t["id"])
                and isinstance(t.get("sha256"), str)
                and _HEX64.match(t["sha256"])
                and (t.get("expires_at") is None or isinstance(t["expires_at"], (int, float)))
            ):
                raise BadInput(f"tokens[{i}] must be {{id, sha256, expires_at}}", f"tokens[{i}]")
            kept.append({"id": t["id"], "sha256": t["sha256"], "expires_at": t.get("expires_at")})
        self.store.directory.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(_write_atomic, self.store.directory / READERS_FILE,
                                json.dumps({"tokens": kept}).encode())  # fmt: skip
        return web.json_response({"tokens": len(kept)})

    # -- helpers ------------------------------------------------------------------------------

    def _held(self, raw: str) -> BackupInfo:
        name = _name(raw)
        try:
            return self.store.get(name)
        except BackupError:
            raise NotHeld(f"no backup {name} at {self.site}", "name") from None

    def _description(self, request: web.Request, name: str) -> BackupInfo:
        raw = request.headers.get(INFO_HEADER)
        if not raw:
            raise BadInput(f"a copy needs its description in {INFO_HEADER}", INFO_HEADER)
        try:
            info = BackupInfo.from_dict(json.loads(raw), INFO_HEADER)
        except (ValueError, BackupError) as exc:
            raise BadInput(str(exc), INFO_HEADER) from exc
        if info.name != name or not _HEX64.match(info.sha256) or info.size_bytes <= 0:
            raise BadInput(
                f"{INFO_HEADER} must describe {name} with its sha256 and size", INFO_HEADER
            )
        return replace(info, copies=())

    async def _receive(self, request: web.Request, dest: Path, expected: int) -> int:
        if request.content_length is not None and request.content_length != expected:
            raise BadInput(
                f"the body has {request.content_length} bytes, its description says {expected}",
                "size_bytes",
            )
        size = 0
        with open(dest, "wb") as out:
            async for chunk in request.content.iter_chunked(BODY_CHUNK):
                size += len(chunk)
                if size > expected:
                    raise TooLarge(f"the body is over the {expected} bytes described", None)
                out.write(chunk)
        return size


def _name(raw: str) -> str:
    try:
        return check_backup_name(raw)
    except BackupError as exc:
        raise BadInput(str(exc), "name") from exc


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
