"""Calls to another site's /data routes that push or look up (pulling is sites.agent.data.
transfer): a job's latest checkpoint, a checkpoint push (missing blobs, then the manifest), an
output's upload. Each failure is a PeerError naming the site and what it answered.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from pydantic import ValidationError

from sites.agent.data.errors import PeerError
from sites.agent.data.links import TokenBucket
from sites.agent.data.transfer import GRANT_HEADER
from sites.model.data import CheckpointMark, Manifest, Source

CHUNK = 256 * 1024


def grant_scope(token: str) -> str:
    """The scope a grant names (its payload is signed, not secret: only its signer checks it)."""
    payload = token.partition(".")[0]
    try:
        raw = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return str(raw["scope"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PeerError("the grant is malformed: it names no scope") from exc


async def _answer(resp: aiohttp.ClientResponse, src: Source, what: str) -> Any:
    if resp.status < 300:
        return await resp.json(content_type=None)
    try:
        body = await resp.json(content_type=None)
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        message = resp.reason or ""
    raise PeerError(f"site {src.site} refused {what}: {resp.status} {message}".strip())


async def _call(
    session: aiohttp.ClientSession,
    method: str,
    src: Source,
    path: str,
    what: str,
    *,
    json_body: Any = None,
    data: Any = None,
    missing_ok: bool = False,
) -> Any:
    try:
        async with session.request(
            method, f"{src.url}{path}", headers={GRANT_HEADER: src.grant}, json=json_body,
            data=data,
        ) as resp:  # fmt: skip
            if missing_ok and resp.status == 404:
                return None
            return await _answer(resp, src, what)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise PeerError(f"site {src.site} cannot be reached for {what}: {exc}") from exc


async def latest_checkpoint(
    session: aiohttp.ClientSession, src: Source, tenant: str, job: str
) -> tuple[CheckpointMark, Manifest] | None:
    """The job's last complete checkpoint at `src`, or None when it holds none."""
    what = f"the latest checkpoint of {tenant}/{job}"
    body = await _call(
        session, "GET", src, f"/data/checkpoints/{tenant}/{job}/latest", what, missing_ok=True
    )
    if body is None:
        return None
    try:
        return CheckpointMark.model_validate(body["mark"]), Manifest.model_validate(
            body["manifest"]
        )
    except (ValidationError, KeyError, TypeError) as exc:
        raise PeerError(f"site {src.site} answered {what} with something else") from exc


async def _file_body(path: Path, bucket: TokenBucket | None) -> AsyncIterator[bytes]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(CHUNK):
            if bucket is not None:
                await bucket.take(len(chunk))
            yield chunk


async def push_checkpoint(
    session: aiohttp.ClientSession,
    src: Source,
    *,
    tenant: str,
    job: str,
    seq: int,
    manifest: Manifest,
    at: float,
    step: int | None,
    file_of: Callable[[str], Path],
    bucket: TokenBucket | None = None,
) -> tuple[CheckpointMark, int]:
    """Send the blobs `src` lacks (read from `file_of(path)`), then the manifest; the mark
    and how many bytes were sent."""
    by_sha = {f.sha256: f for f in manifest.files}
    asked = await _call(
        session, "POST", src, "/data/blobs/missing", "which blobs it lacks",
        json_body={"sha256": sorted(by_sha)},
    )  # fmt: skip
    missing = asked.get("missing") if isinstance(asked, dict) else None
    if not isinstance(missing, list):
        raise PeerError(f"site {src.site} answered which blobs it lacks with something else")
    sent = 0
    for sha in missing:
        entry = by_sha.get(sha)
        if entry is None:
            continue
        await _call(
            session, "PUT", src, f"/data/blobs/{sha}", f"the blob of {entry.path!r}",
            data=_file_body(file_of(entry.path), bucket),
        )  # fmt: skip
        sent += entry.size
    body = {"manifest": manifest.model_dump(mode="json"), "at": at, "step": step}
    answer = await _call(
        session, "PUT", src, f"/data/checkpoints/{tenant}/{job}/{seq}",
        f"checkpoint {seq} of {tenant}/{job}", json_body=body,
    )  # fmt: skip
    try:
        return CheckpointMark.model_validate(answer), sent
    except ValidationError as exc:
        raise PeerError(f"site {src.site} answered a checkpoint with something else") from exc


async def upload(
    session: aiohttp.ClientSession,
    src: Source,
    manifest: Manifest,
    *,
    file_of: Callable[[str], Path],
    bucket: TokenBucket | None = None,
) -> str:
    """Upload every file of `manifest` under the upload its grant names, then commit it; the
    digest `src` answered."""
    kind, _, rest = grant_scope(src.grant).partition(":")
    upload_id = rest.rpartition("/")[2]
    if kind != "upload" or not upload_id:
        raise PeerError(f"the grant for site {src.site} is not an upload's")
    for f in manifest.files:
        await _call(
            session, "PUT", src, f"/data/uploads/{upload_id}/files/{quote(f.path)}",
            f"file {f.path!r}", data=_file_body(file_of(f.path), bucket),
        )  # fmt: skip
    answer = await _call(
        session, "POST", src, f"/data/uploads/{upload_id}/commit", "the upload's commit",
        json_body=manifest.model_dump(mode="json"),
    )  # fmt: skip
    if not isinstance(answer, dict) or answer.get("digest") != manifest.digest:
        raise PeerError(f"site {src.site} committed another digest than {manifest.digest[:12]}")
    return manifest.digest
