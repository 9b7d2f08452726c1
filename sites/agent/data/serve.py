"""The data store's HTTP routes under /data/ on the agent's server (docs/agent.md lists them).

Every request carries a grant in `X-Cpn-Grant`, minted by the broker with this agent's data key
(sites.model.data): 401 without one or with a forged, expired or other site's grant, 403 when
it does not cover what is asked. Reading an object takes `obj:<digest>`, or `ckpt:<tenant>/<job>`
when the object is one of that job's checkpoints here; uploads take a write grant on
`upload:<tenant>/<id>`, checkpoint pushes one on `ckpt:<tenant>/<job>`. The agent's bearer
(sites.agent.server) is not asked for: the grant is the authority, and says for what.

Files are sent from the blob of their sha256 (never from the object's tree: aiohttp would send
a sibling `<name>.gz` to a client that accepts gzip), with ranges (206) and `X-Cpn-Sha256`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import operator
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from sites.agent.data.backups import BackupShelf
from sites.agent.data.errors import BadInput, DataError, TooLarge, json_list
from sites.agent.data.store import DataStore, check_name, check_sha
from sites.agent.data.transfer import GRANT_HEADER, SHA_HEADER
from sites.kits.clock import Clock
from sites.model.data import Claims, GrantError, Manifest, allows, clean_path, verify

log = logging.getLogger(__name__)

MAX_MISSING_ASK = 100_000
BODY_CHUNK = 256 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.field = status, code, field


def error(status: int, code: str, message: str, field: str | None) -> web.Response:
    return web.json_response(
        {"error": {"code": code, "message": message, "field": field}}, status=status
    )


def _guarded(handler: Handler) -> Handler:
    """A refusal or a DataError as its JSON error (a DataError that is not a client's fault
    is logged as the bug it is)."""

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except _Refused as exc:
            return error(exc.status, exc.code, str(exc), exc.field)
        except DataError as exc:
            if exc.status == 500:
                log.exception("data route %s failed", request.path)
            return error(exc.status, exc.code, str(exc), exc.field)

    return run


ROUTES = (
    ("GET", "/data/manifests/{digest}", "get_manifest"),
    ("GET", "/data/objects/{digest}/{path:.*}", "get_file"),
    ("PUT", "/data/uploads/{id}/files/{path:.*}", "put_upload_file"),
    ("POST", "/data/uploads/{id}/commit", "commit_upload"),
    ("POST", "/data/blobs/missing", "missing_blobs"),
    ("PUT", "/data/blobs/{sha}", "put_blob"),
    ("GET", "/data/checkpoints/{tenant}/{job}/latest", "latest_checkpoint"),
    ("PUT", "/data/checkpoints/{tenant}/{job}/{seq}", "put_checkpoint"),
    # the registry's backups kept here for the federation (sites.agent.data.backups)
    ("GET", "/data/backups", "shelf.list_backups"),
    ("GET", "/data/backups/{name}", "shelf.get_backup"),
    ("PUT", "/data/backups/{name}", "shelf.put_backup"),
    ("DELETE", "/data/backups/{name}", "shelf.delete_backup"),
    ("PUT", "/data/backup-readers", "shelf.put_readers"),
)


def add_routes(router: web.UrlDispatcher, resolve: Callable[[], DataRoutes | None]) -> None:
    """The /data/ routes, answered by `resolve()` (503 while it is None: the store opens once
    the agent holds its site)."""
    for method, path, name in ROUTES:

        async def handler(request: web.Request, name: str = name) -> web.StreamResponse:
            routes = resolve()
            if routes is None:
                return error(503, "unavailable", "the data store is not open yet", None)
            answer: Handler = operator.attrgetter(name)(routes)
            return await _guarded(answer)(request)

        if method == "GET":
            router.add_get(path, handler, allow_head=True)
        else:
            router.add_route(method, path, handler)


class _HeldFile(web.FileResponse):
    """A file response that lets its object go once sent (or refused)."""

    def __init__(self, path: Path, *, release: Callable[[], object], **kw: Any) -> None:
        super().__init__(path, **kw)
        self._release = release

    async def prepare(self, request: web.BaseRequest) -> Any:
        try:
            return await super().prepare(request)
        finally:
            self._release()


class DataRoutes:
    """The /data/ routes of one store (module docstring). `committed(digest)` is awaited once
    an object became complete here through them (replica record, eviction)."""

    def __init__(
        self,
        *,
        store: DataStore,
        site: str,
        key: str,
        clock: Clock,
        committed: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.site = site
        self.key = key
        self.clock = clock
        self._committed = committed
        self.shelf = BackupShelf(
            directory=store.root / "backups", site=site, key=key, clock=clock,
            limit_bytes=store.limit_bytes,
        )  # fmt: skip

    def add_to(self, router: web.UrlDispatcher) -> None:
        add_routes(router, lambda: self)

    # -- grants ---------------------------------------------------------------------------

    def _claims(self, request: web.Request) -> Claims:
        token = request.headers.get(GRANT_HEADER)
        if not token:
            raise _Refused(401, "unauthorized", f"a grant is needed in {GRANT_HEADER}", "grant")
        try:
            return verify(self.key, token, site=self.site, now=self.clock.time())
        except GrantError as exc:
            raise _Refused(401, "unauthorized", str(exc), "grant") from exc

    def _may_read(self, claims: Claims, digest: str) -> None:
        if allows(claims, f"obj:{digest}", "read"):
            return
        kind, _, rest = claims.scope.partition(":")
        if kind == "ckpt":
            tenant, _, job = rest.partition("/")
            try:
                if digest in self.store.checkpoint_digests(tenant, job):
                    return
            except BadInput:
                pass
        raise _Refused(403, "forbidden", f"the grant for {claims.scope} does not cover "
                       f"object {digest[:12]}", "grant")  # fmt: skip

    def _may_write(self, claims: Claims, scope: str) -> None:
        if not (allows(claims, scope, "write") and claims.op == "write"):
            raise _Refused(403, "forbidden", f"the grant for {claims.op} on {claims.scope} does "
                           f"not allow writing {scope}", "grant")  # fmt: skip

    def _may_push_blobs(self, claims: Claims) -> None:
        if not (claims.scope.startswith("ckpt:") and claims.op == "write"):
            raise _Refused(403, "forbidden", "blobs are pushed with a checkpoint's write grant",
                           "grant")  # fmt: skip

    # -- reading --------------------------------------------------------------------------

    async def get_manifest(self, request: web.Request) -> web.Response:
        claims = self._claims(request)
        digest = check_sha(request.match_info["digest"], "digest")
        self._may_read(claims, digest)
        manifest = self.store.manifest(digest)
        return web.Response(
            body=manifest.model_dump_json().encode(), content_type="application/json"
        )

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        claims = self._claims(request)
        digest = check_sha(request.match_info["digest"], "digest")
        try:
            path = clean_path(request.match_info["path"])
        except ValueError as exc:
            raise BadInput(str(exc), "path") from exc
        self._may_read(claims, digest)
        _, _, sha = self.store.file(digest, path)
        holder = f"serve:{secrets.token_hex(6)}"
        self.store.acquire(digest, holder)  # not evicted while it is sent
        return _HeldFile(
            self.store.blobs / sha,
            release=lambda: self.store.release(holder),
            headers={SHA_HEADER: sha, "Content-Type": "application/octet-stream"},
        )

    async def latest_checkpoint(self, request: web.Request) -> web.Response:
        claims = self._claims(request)
        tenant = check_name(request.match_info["tenant"], "tenant")
        job = check_name(request.match_info["job"], "job")
        scope = f"ckpt:{tenant}/{job}"
        if not allows(claims, scope, "read"):
            raise _Refused(403, "forbidden", f"the grant does not cover {scope}", "grant")
        mark = self.store.latest(tenant, job)
        if mark is None:
            raise _Refused(404, "not_found", f"no complete checkpoint of {tenant}/{job} here")
        manifest = self.store.manifest(mark.digest)
        body = {"mark": mark.model_dump(mode="json"), "manifest": manifest.model_dump(mode="json")}
        return web.json_response(body)

    # -- uploads --------------------------------------------------------------------------

    def _upload_scope(self, claims: Claims, upload_id: str) -> None:
        kind, _, rest = claims.scope.partition(":")
        if kind != "upload" or rest.rpartition("/")[2] != upload_id:
            raise _Refused(403, "forbidden", f"the grant for {claims.scope} does not cover "
                           f"upload {upload_id}", "grant")  # fmt: skip
        self._may_write(claims, claims.scope)

    async def put_upload_file(self, request: web.Request) -> web.Response:
        claims = self._claims(request)
        upload_id = check_name(request.match_info["id"], "upload")
        try:
            path = clean_path(request.match_info["path"])
        except ValueError as exc:
            raise BadInput(str(exc), "path") from exc
        self._upload_scope(claims, upload_id)
        dest = self.store.upload_file(upload_id, path)
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
        size, sha = await self._receive(request, tmp)
        os.replace(tmp, dest)
        return web.json_response({"path": path, "bytes": size, "sha256": sha}, status=201)

    async def commit_upload(self, request: web.Request) -> web.Response:
        claims = self._claims(request)
        upload_id = check_name(request.match_info["id"], "upload")
        self._upload_scope(claims, upload_id)
        manifest = await _manifest_body(request)
        await asyncio.to_thread(self.store.commit_upload, upload_id, manifest)
        await self._done(manifest.digest)
        body = {"digest": manifest.digest, "bytes": manifest.bytes, "files": len(manifest.files)}
        return web.json_response(body, status=201)

    # -- checkpoint pushes ------------------------------------------------------------------

    async def missing_blobs(self, request: web.Request) -> web.Response:
        self._may_push_blobs(self._claims(request))
        shas = await json_list(request, "sha256", MAX_MISSING_ASK)
        for s in shas:
            check_sha(s if isinstance(s, str) else repr(s))
        return web.json_response({"missing": self.store.missing_blobs(shas)})

    async def put_blob(self, request: web.Request) -> web.Response:
        self._may_push_blobs(self._claims(request))
        sha = check_sha(request.match_info["sha"])
        tmp = self.store.temp()
        try:
            size, got = await self._receive(request, tmp)
            if got != sha:
                raise BadInput(f"the body has sha256 {got}, not {sha}", "sha256")
            await asyncio.to_thread(self.store.adopt, sha, tmp)
        finally:
            tmp.unlink(missing_ok=True)
        return web.json_response({"sha256": sha, "bytes": size}, status=201)

    async def put_checkpoint(self, request: web.Request) -> web.Response:
        claims = self._claims(request)
        tenant = check_name(request.match_info["tenant"], "tenant")
        job = check_name(request.match_info["job"], "job")
        self._may_write(claims, f"ckpt:{tenant}/{job}")
        raw_seq = request.match_info["seq"]
        if not raw_seq.isdigit() or int(raw_seq) < 1:
            raise BadInput(f"seq must be a whole number from 1, got {raw_seq!r}", "seq")
        try:
            body = await request.json()
        except ValueError as exc:
            raise BadInput("the body is not JSON", None) from exc
        if not isinstance(body, dict):
            raise BadInput('the body must be {"manifest", "at", "step"}', None)
        manifest = _parse_manifest(body.get("manifest"), "manifest")
        at, step = body.get("at"), body.get("step")
        if not isinstance(at, (int, float)) or isinstance(at, bool):
            raise BadInput("at must be unix seconds", "at")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise BadInput("step must be an integer or null", "step")
        mark = await asyncio.to_thread(
            self.store.put_checkpoint, tenant, job, int(raw_seq), manifest,
            at=float(at), step=step, site=self.site,
        )  # fmt: skip
        await self._done(manifest.digest)
        return web.json_response(mark.model_dump(mode="json"), status=201)

    # -- helpers ------------------------------------------------------------------------------

    async def _receive(self, request: web.Request, dest: Path) -> tuple[int, str]:
        """The body into `dest`, hashed; TooLarge past the store's limit (dest removed)."""
        limit = self.store.limit_bytes
        if request.content_length is not None and request.content_length > limit:
            raise TooLarge(f"the body ({request.content_length} bytes) is over the store's "
                           f"{limit}", None)  # fmt: skip
        hasher = hashlib.sha256()
        size = 0
        try:
            with open(dest, "wb") as out:
                async for chunk in request.content.iter_chunked(BODY_CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise TooLarge(f"the body is over the store's {limit} bytes", None)
                    out.write(chunk)
                    hasher.update(chunk)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return size, hasher.hexdigest()

    async def _done(self, digest: str) -> None:
        if self._committed is not None:
            await self._committed(digest)


async def _manifest_body(request: web.Request) -> Manifest:
    try:
        raw: Any = await request.json()
    except ValueError as exc:
        raise BadInput("the body is not JSON", None) from exc
    return _parse_manifest(raw, None)


def _parse_manifest(raw: Any, where: str | None) -> Manifest:
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        field = ".".join(p for p in (where, loc) if p) or None
        raise BadInput(f"{field or 'manifest'}: {first['msg']}", field) from exc
