"""/v1/datasets: datasets' HTTP side (docs/data.md). Thin handlers over broker.ops.datasets.

A tenant's token sees its own datasets and those shared with it; another tenant's answers 404
(as one that does not exist); a tenant it is shared with may read and download, not put,
share, replicate or remove (403, field owner). File bytes never pass through the broker's
memory whole: an upload's body is streamed to the site's agent as it comes, a download is
streamed from the best holder (the version's home first), Range passed through.
"""

from __future__ import annotations

import json
import re
from typing import TypeVar
from urllib.parse import quote

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from broker.api.access import note, principal
from broker.api.bodies import page_response, query_limit
from broker.api.keys import BROKER, HTTP
from broker.api.openapi import CONTINUE, JSON, Operation, Param, Reply
from broker.model.datasets import (
    DatasetInfo,
    DatasetMeta,
    DatasetSummary,
    DatasetVersion,
    PutBegin,
    ReplicateRequest,
    ReplicationStarted,
    ShareRequest,
    UploadCommit,
    UploadStarted,
)
from broker.model.errors import InvalidRequest
from broker.model.jobs import NAME_RE
from broker.ops.datasets import DataPlaneError, Datasets, parse_upload
from sites.model.data import DATASET_NAME_RE, MAX_PATH, PATH_PATTERN, Manifest, clean_path

__all__ = ["dataset_operations"]

M = TypeVar("M", bound=BaseModel)

MAX_MANIFEST_BODY = 8 * 1024 * 1024  # a manifest of MAX_FILES files with long paths
LIST_LIMIT = 100
LIST_MAX = 1000
CHUNK = 256 * 1024
_PASS_HEADERS = ("Content-Length", "Content-Range", "Accept-Ranges", "ETag", "X-Cpn-Sha256")
_VERSION_RE = re.compile(r"^[1-9][0-9]{0,8}$")
OCTETS = "application/octet-stream"


class DatasetList(BaseModel):
    """A page of GET /v1/datasets, by owner and name; `continue` asks for the next page."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    items: list[DatasetSummary]
    continue_: str | None = Field(
        alias="continue", description="pass as ?continue= for the next page; null on the last"
    )


class FileStored(BaseModel):
    """The agent's answer to one uploaded file."""

    path: str
    bytes: int
    sha256: str


def _ops(request: web.Request) -> Datasets:
    return request.app[BROKER].datasets


def _tenant(request: web.Request) -> str | None:
    return principal(request).tenant


def _named(request: web.Request) -> tuple[str, str]:
    owner, name = request.match_info["owner"], request.match_info["name"]
    note(request, tenant=owner, target=f"{owner}/{name}")
    return owner, name


def _version(request: web.Request) -> int:
    text = request.match_info["version"]
    if not _VERSION_RE.match(text):
        raise InvalidRequest(
            f"version must be a whole number from 1, got {text!r}", field="version"
        )
    return int(text)


def _file_path(request: web.Request) -> str:
    try:
        return clean_path(request.match_info["path"])
    except ValueError as exc:
        raise InvalidRequest(str(exc), field="path") from None


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(model.model_dump(mode="json", by_alias=True), status=status)


def _refused(exc: DataPlaneError) -> web.Response:
    body = {"error": {"code": exc.code, "message": exc.message, "field": exc.field}}
    return web.json_response(body, status=exc.status)


async def _read_json(request: web.Request, model: type[M]) -> M:
    """A JSON body (a manifest may be larger than the API's usual limit), strictly validated."""
    if "Content-Type" in request.headers and request.content_type != JSON:
        raise InvalidRequest(
            f"unsupported content type {request.content_type!r}: send {JSON}",
            field="Content-Type",
            code="unsupported_media",
        )
    raw = bytearray()
    async for chunk in request.content.iter_chunked(CHUNK):
        raw += chunk
        if len(raw) > MAX_MANIFEST_BODY:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_MANIFEST_BODY, actual_size=len(raw))
    return model.model_validate_json(bytes(raw), strict=True)


# -- handlers -------------------------------------------------------------------------------------


async def list_datasets(request: web.Request) -> web.Response:
    limit = query_limit(request.query, default=LIST_LIMIT, maximum=LIST_MAX)
    items, token = await _ops(request).page(
        tenant=_tenant(request), limit=limit, after=request.query.get("continue") or None
    )
    return page_response([i.model_dump_json().encode() for i in items], token)


async def describe(request: web.Request) -> web.Response:
    owner, name = _named(request)
    return _json(await _ops(request).describe(owner, name, tenant=_tenant(request)))


async def remove(request: web.Request) -> web.Response:
    owner, name = _named(request)
    return _json(await _ops(request).remove(owner, name, None, tenant=_tenant(request)))


async def remove_version(request: web.Request) -> web.Response:
    owner, name = _named(request)
    version = _version(request)
    note(request, target=f"{owner}/{name}@{version}")
    meta = await _ops(request).remove(owner, name, version, tenant=_tenant(request))
    return _json(meta)


async def begin(request: web.Request) -> web.Response:
    owner, name = _named(request)
    body = await _read_json(request, PutBegin)
    started = await _ops(request).begin(owner, name, body, tenant=_tenant(request))
    return _json(started, 201)


async def upload_file(request: web.Request) -> web.StreamResponse:
    """Stream the body to the upload's agent as it comes (never held whole)."""
    owner, name = _named(request)
    upload = request.match_info["upload"]
    parse_upload(upload)
    path = _file_path(request)
    ops = _ops(request)
    await ops.writable(owner, name, tenant=_tenant(request))
    try:
        target = ops.upload_target(owner, upload)
    except DataPlaneError as exc:
        return _refused(exc)
    url = f"{target.url}/data/uploads/{quote(upload)}/files/{quote(path)}"
    headers = {"X-Cpn-Grant": target.grant, "Content-Type": OCTETS}
    if request.content_length is not None:
        headers["Content-Length"] = str(request.content_length)
    try:
        async with request.app[HTTP].put(
            url, data=request.content.iter_chunked(CHUNK), headers=headers
        ) as answer:
            raw = await answer.read()
            status = answer.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return _refused(
            DataPlaneError(502, "site_unreachable", f"cannot reach {target.site}: {exc}")
        )
    return _agent_answer(raw, status, target.site, field="path")


def _agent_answer(
    raw: bytes, status: int, site: str, *, field: str, missing: int = 409
) -> web.Response:
    """The agent's answer as ours: its success as it is, its refusals as 4xx, its failures 502."""
    if status < 300:
        return web.Response(body=raw, status=201, content_type=JSON)
    try:
        error = json.loads(raw)["error"]
        code, message, named = str(error["code"]), str(error["message"]), error.get("field")
    except (ValueError, KeyError, TypeError):
        code, message, named = "refused", raw.decode(errors="replace")[:300], None
    if status in (400, 404, 409, 413, 416):
        out = {404: missing, 409: 409}.get(status, status)
        return _refused(DataPlaneError(out, code, message, named or field))
    return _refused(DataPlaneError(502, "site_error", f"{site}: {message}"))


async def commit(request: web.Request) -> web.Response:
    owner, name = _named(request)
    upload = request.match_info["upload"]
    parse_upload(upload)
    body = await _read_json(request, UploadCommit)
    who = principal(request)
    try:
        version = await _ops(request).commit(
            owner, name, upload, body.manifest,
            tenant=who.tenant, made_by=f"put by {who.token_id}",
            description=body.description, http=request.app[HTTP],
        )  # fmt: skip
    except DataPlaneError as exc:
        return _refused(exc)
    note(request, target=version.ref)
    return _json(version, 201)


async def replicate(request: web.Request) -> web.Response:
    owner, name = _named(request)
    body = await _read_json(request, ReplicateRequest)
    started = await _ops(request).replicate(owner, name, body, tenant=_tenant(request))
    return _json(started, 202)


async def share(request: web.Request) -> web.Response:
    owner, name = _named(request)
    body = await _read_json(request, ShareRequest)
    return _json(await _ops(request).share(owner, name, body, tenant=_tenant(request)))


async def manifest(request: web.Request) -> web.Response:
    owner, name = _named(request)
    ref = f"{owner}/{name}@{_version(request)}"
    ops = _ops(request)
    found = await ops.resolve(tenant=_tenant(request), ref=ref, field="name")
    return _json(await ops.manifest(found.digest))


async def download(request: web.Request) -> web.StreamResponse:
    """One file of a version, streamed from the first holder that answers (Range passed)."""
    owner, name = _named(request)
    version = _version(request)
    path = _file_path(request)
    ops = _ops(request)
    found = await ops.resolve(
        tenant=_tenant(request), ref=f"{owner}/{name}@{version}", field="name"
    )
    headers = {k: v for k, v in request.headers.items() if k in ("Range", "If-Range")}
    last: DataPlaneError | None = None
    for source in ops.download_sources(found):
        url = f"{source.url}/data/objects/{found.digest}/{quote(path)}"
        try:
            async with request.app[HTTP].get(
                url, headers={**headers, "X-Cpn-Grant": source.grant}
            ) as answer:
                if answer.status == 404:
                    raw = await answer.read()
                    return _agent_answer(raw, 404, source.site, field="path", missing=404)
                if answer.status >= 300:
                    raw = await answer.read()
                    if answer.status in (400, 416):
                        return _agent_answer(raw, answer.status, source.site, field="path")
                    last = DataPlaneError(502, "site_error", f"{source.site}: {answer.status}")
                    continue
                response = web.StreamResponse(status=answer.status)
                response.content_type = OCTETS
                for header in _PASS_HEADERS:
                    if header in answer.headers:
                        response.headers[header] = answer.headers[header]
                response.headers["X-Cpn-Site"] = source.site
                await response.prepare(request)
                async for chunk in answer.content.iter_chunked(CHUNK):
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = DataPlaneError(502, "site_unreachable", f"cannot reach {source.site}: {exc}")
    return _refused(
        last or DataPlaneError(503, "no_replica", f"no site holding {found.ref} is up now")
    )


# -- the route table -----------------------------------------------------------------------------

OWNER = Param("owner", "path", "the owning tenant", {"type": "string", "pattern": NAME_RE})
NAME = Param(
    "name", "path", "the dataset's name", {"type": "string", "pattern": DATASET_NAME_RE.pattern}
)
VERSION = Param(
    "version", "path", "a version number",
    {"type": "string", "pattern": _VERSION_RE.pattern},
)  # fmt: skip
UPLOAD = Param(
    "upload", "path", "the upload's id (its begin's answer)",
    {"type": "string", "pattern": r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.[0-9a-f]{16}$"},
)  # fmt: skip
PATH = Param(
    "path", "path", "the file's path in the dataset ('/' between parts)",
    {"type": "string", "minLength": 1, "maxLength": MAX_PATH, "pattern": PATH_PATTERN},
)  # fmt: skip
BASE = "/v1/datasets/{owner}/{name}"
ONLY_JSON = (JSON,)


def dataset_operations() -> list[Operation]:
    """The /v1/datasets routes (registered by broker.api.app)."""
    meta: dict[int | str, Reply] = {200: Reply("the dataset as it is now", DatasetMeta)}
    removed: dict[int | str, Reply] = {200: Reply("the dataset's meta before", DatasetMeta)}
    list_params: tuple[Param, ...] = (
        Param(
            "limit", "query", f"at most this many datasets (default {LIST_LIMIT})",
            {"type": "integer", "minimum": 1, "maximum": LIST_MAX},
        ),
        CONTINUE,
    )  # fmt: skip
    return [
        Operation(
            "GET", "/v1/datasets", list_datasets,
            "Datasets: the tenant's own and those shared with it", "list_datasets",
            params=list_params, replies={200: Reply("a page of datasets", DatasetList)},
            errors=(400, 503),
        ),
        Operation(
            "GET", BASE, describe, "A dataset: its versions, sizes and replicas",
            "describe_dataset", params=(OWNER, NAME),
            replies={200: Reply("the dataset", DatasetInfo)}, errors=(400, 404, 503),
        ),
        Operation(
            "DELETE", BASE, remove, "Remove a dataset, every version", "remove_dataset",
            params=(OWNER, NAME), replies=removed, errors=(400, 404, 409, 503),
        ),
        Operation(
            "DELETE", BASE + "/versions/{version}", remove_version, "Remove one version",
            "remove_dataset_version", params=(OWNER, NAME, VERSION), replies=removed,
            errors=(400, 404, 409, 503),
        ),
        Operation(
            "POST", BASE + "/uploads", begin, "Begin putting a new version: where, and its id",
            "begin_upload", params=(OWNER, NAME), body=PutBegin, body_types=ONLY_JSON,
            replies={201: Reply("the upload", UploadStarted)},
            errors=(400, 404, 413, 415, 503),
        ),
        Operation(
            "PUT", BASE + "/uploads/{upload}/files/{path:.*}", upload_file,
            "Upload one file of a begun put (streamed to the site)", "upload_file",
            params=(OWNER, NAME, UPLOAD, PATH), body={"type": "string", "format": "binary"},
            body_types=(OCTETS,), body_required=False,
            replies={201: Reply("stored at the site", FileStored)},
            errors=(400, 404, 409, 413, 502, 503),
        ),
        Operation(
            "POST", BASE + "/uploads/{upload}/commit", commit,
            "Check the uploaded files and register the new version", "commit_upload",
            params=(OWNER, NAME, UPLOAD), body=UploadCommit, body_types=ONLY_JSON,
            replies={201: Reply("the new version", DatasetVersion)},
            errors=(400, 404, 409, 413, 415, 502, 503),
        ),
        Operation(
            "POST", BASE + "/replicate", replicate,
            "Keep a version at a site or a region's best site (pulled there)",
            "replicate_dataset", params=(OWNER, NAME), body=ReplicateRequest,
            body_types=ONLY_JSON,
            replies={202: Reply("ordered, or held there", ReplicationStarted)},
            errors=(400, 404, 409, 413, 415, 503),
        ),
        Operation(
            "PUT", BASE + "/shares", share, "Share with tenants, or stop", "share_dataset",
            params=(OWNER, NAME), body=ShareRequest, body_types=ONLY_JSON, replies=meta,
            errors=(400, 404, 409, 413, 415, 503),
        ),
        Operation(
            "GET", BASE + "/versions/{version}/manifest", manifest,
            "A version's files: path, size, sha256", "dataset_manifest",
            params=(OWNER, NAME, VERSION), replies={200: Reply("the manifest", Manifest)},
            errors=(400, 404, 503),
        ),
        Operation(
            "GET", BASE + "/versions/{version}/files/{path:.*}", download,
            "Download one file of a version (Range supported)", "download_file",
            params=(OWNER, NAME, VERSION, PATH),
            replies={
                200: Reply("the file", {"type": "string", "format": "binary"}, OCTETS),
                206: Reply("the range asked", {"type": "string", "format": "binary"}, OCTETS),
            },
            errors=(400, 404, 409, 416, 502, 503),
        ),
    ]  # fmt: skip
