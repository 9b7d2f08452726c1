"""The /data routes as peers and the broker call them: grants, reads with ranges, uploads,
checkpoint pushes; every refusal with its status, code and field."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sites.agent.data.store import INCOMING_TTL_S, DataStore
from sites.agent.data.transfer import GRANT_HEADER, SHA_HEADER
from sites.model.data import Claims, mint
from tests.sites.agent.data.conftest import MakePeer, grant, manifest_of, put_blobs

FILES = {"a.txt": b"hello world\n" * 100, "sub/b.bin": bytes(range(256)) * 40}


async def call(method: str, url: str, token: str | None, **kw: Any) -> tuple[int, Any, Any]:
    headers = dict(kw.pop("headers", {}))
    if token is not None:
        headers[GRANT_HEADER] = token
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, headers=headers, **kw) as resp,
    ):
        raw = await resp.read()
        if resp.content_type == "application/json":
            return resp.status, await resp.json(), resp.headers
        return resp.status, raw, resp.headers


def error_of(body: Any) -> tuple[str, str | None]:
    return body["error"]["code"], body["error"]["field"]


async def test_grants_forged_expired_other_site_or_scope_are_refused(make_peer: MakePeer) -> None:
    peer = await make_peer("site-a")
    m = put_blobs(peer.store, FILES)
    url = f"{peer.url}/data/manifests/{m.digest}"
    good = grant(peer.key, "site-a", f"obj:{m.digest}")
    status, body, _ = await call("GET", url, good)
    assert status == 200 and body == m.model_dump(mode="json")

    other_key = "k" * 43
    refused = {
        "none": None,
        "forged": grant(other_key, "site-a", f"obj:{m.digest}"),
        "expired": grant(peer.key, "site-a", f"obj:{m.digest}", exp_s=-5),
        "other site": grant(peer.key, "site-b", f"obj:{m.digest}"),
        "garbage": "not-a-grant",
        "tampered": good[:-3] + ("AAA" if not good.endswith("AAA") else "BBB"),
    }
    for why, token in refused.items():
        status, body, _ = await call("GET", url, token)
        assert status == 401, why
        assert error_of(body) == ("unauthorized", "grant"), why
    # a good grant for another object, a job's checkpoints, or an upload
    for scope in (f"obj:{'0' * 64}", "ckpt:acme/job-1", "upload:acme/u1"):
        status, body, _ = await call("GET", url, grant(peer.key, "site-a", scope, "write"))
        assert status == 403 and error_of(body) == ("forbidden", "grant"), scope
    # a file of the object with that grant: the same refusal
    status, _, _ = await call(
        "GET", f"{peer.url}/data/objects/{m.digest}/a.txt", grant(peer.key, "site-a", "obj:x")
    )
    assert status == 403


async def test_reads_ranges_and_bad_inputs(make_peer: MakePeer) -> None:
    peer = await make_peer("site-a")
    m = put_blobs(peer.store, FILES)
    token = grant(peer.key, "site-a", f"obj:{m.digest}")
    base = f"{peer.url}/data/objects/{m.digest}"
    status, body, headers = await call("GET", f"{base}/sub/b.bin", token)
    assert status == 200 and body == FILES["sub/b.bin"]
    assert headers[SHA_HEADER] == hashlib.sha256(FILES["sub/b.bin"]).hexdigest()
    status, body, headers = await call(
        "GET", f"{base}/a.txt", token, headers={"Range": "bytes=100-"}
    )
    assert status == 206 and body == FILES["a.txt"][100:]
    assert headers["Content-Range"] == f"bytes 100-{len(FILES['a.txt']) - 1}/{len(FILES['a.txt'])}"
    status, body, headers = await call("HEAD", f"{base}/a.txt", token)
    assert status == 200 and headers["Content-Length"] == str(len(FILES["a.txt"]))

    status, body, _ = await call("GET", f"{base}/nope.txt", token)
    assert status == 404 and error_of(body) == ("not_found", "path")
    status, body, _ = await call("GET", f"{base}/a%2F%2Fb", token)
    assert status == 400 and error_of(body) == ("invalid", "path")
    status, body, _ = await call("GET", f"{peer.url}/data/manifests/XYZ", token)
    assert status == 400 and error_of(body) == ("invalid", "digest")
    unknown = "1" * 64
    status, body, _ = await call(
        "GET", f"{peer.url}/data/manifests/{unknown}", grant(peer.key, "site-a", f"obj:{unknown}")
    )
    assert status == 404 and error_of(body) == ("not_found", "digest")


async def test_upload_commit_checks_every_file_and_names_the_bad_one(make_peer: MakePeer) -> None:
    peer = await make_peer("site-a")
    token = grant(peer.key, "site-a", "upload:acme/u1", "write")
    base = f"{peer.url}/data/uploads/u1"
    for path, data in FILES.items():
        status, body, _ = await call("PUT", f"{base}/files/{path}", token, data=data)
        assert status == 201, body
    # a read grant on the upload, or another upload's grant, may not write
    for other in (grant(peer.key, "site-a", "upload:acme/u1"),
                  grant(peer.key, "site-a", "upload:acme/u2", "write")):  # fmt: skip
        status, body, _ = await call("PUT", f"{base}/files/x", other, data=b"x")
        assert status == 403 and error_of(body) == ("forbidden", "grant")

    wrong = manifest_of({**FILES, "sub/b.bin": b"something else"})
    status, body, _ = await call("POST", f"{base}/commit", token, json=wrong.model_dump())
    assert status == 409 and error_of(body) == ("conflict", "sub/b.bin")
    assert "sub/b.bin" in body["error"]["message"]
    missing = manifest_of({**FILES, "c.txt": b"never sent"})
    status, body, _ = await call("POST", f"{base}/commit", token, json=missing.model_dump())
    assert status == 409 and error_of(body) == ("conflict", "c.txt")
    status, body, _ = await call(
        "POST", f"{base}/commit", token, json={"files": [{"path": "../x"}]}
    )
    assert status == 400 and error_of(body)[0] == "invalid"
    assert not peer.store.digests()  # nothing registered by a failed commit

    right = manifest_of(FILES)
    status, body, _ = await call("POST", f"{base}/commit", token, json=right.model_dump())
    assert status == 201
    assert body == {"digest": right.digest, "bytes": right.bytes, "files": 2}
    assert peer.store.has(right.digest)
    tree = peer.store.tree(right.digest)
    assert (tree / "sub/b.bin").read_bytes() == FILES["sub/b.bin"]
    assert (tree / "a.txt").stat().st_mode & 0o777 == 0o444
    assert tree.stat().st_mode & 0o777 == 0o555
    assert not (peer.store.incoming / "u1").exists()
    # the same commit again (its answer was lost): the same answer
    status, body, _ = await call("POST", f"{base}/commit", token, json=right.model_dump())
    assert status == 201 and body["digest"] == right.digest


async def test_interrupted_upload_leaves_nothing(make_peer: MakePeer, tmp_path: Path) -> None:
    peer = await make_peer("site-a")
    token = grant(peer.key, "site-a", "upload:acme/u9", "write")
    status, _, _ = await call(
        "PUT", f"{peer.url}/data/uploads/u9/files/a.txt", token, data=b"half of it"
    )
    assert status == 201
    await peer.stop()
    assert not peer.store.digests()
    # the agent restarts within the hour: the upload is still there to be committed ...
    again = DataStore(peer.store.root, peer.store.limit_bytes)
    assert (again.incoming / "u9").exists() and not again.digests()
    # ... and an hour later it is swept, on open as by the agent's loop
    old = time.time() - INCOMING_TTL_S - 1
    os.utime(again.incoming / "u9", (old, old))
    later = DataStore(peer.store.root, peer.store.limit_bytes)
    assert not (later.incoming / "u9").exists() and not later.digests()
    assert not list(later.manifests.iterdir())


async def test_checkpoint_push_routes(make_peer: MakePeer) -> None:
    peer = await make_peer("site-d")
    files = {"model.pt": b"weights" * 1000, "step": b"7\n"}
    m = manifest_of(files)
    write = grant(peer.key, "site-d", "ckpt:acme/job-1", "write")
    read = grant(peer.key, "site-d", "ckpt:acme/job-1")
    base = f"{peer.url}/data"
    shas = [f.sha256 for f in m.files]
    status, body, _ = await call("POST", f"{base}/blobs/missing", write, json={"sha256": shas})
    assert status == 200 and body == {"missing": sorted(shas)}
    status, body, _ = await call("POST", f"{base}/blobs/missing", read, json={"sha256": shas})
    assert status == 403
    status, body, _ = await call("POST", f"{base}/blobs/missing", write, json={"sha256": ["x"]})
    assert status == 400 and error_of(body) == ("invalid", "sha256")
    body_ckpt = {"manifest": m.model_dump(), "at": 100.0, "step": 7}
    status, body, _ = await call("PUT", f"{base}/checkpoints/acme/job-1/1", write, json=body_ckpt)
    assert status == 409 and error_of(body)[0] == "conflict"  # no blob yet: named
    status, body, _ = await call(
        "PUT", f"{base}/blobs/{shas[0]}", write, data=b"not what its name says"
    )
    assert status == 400 and error_of(body) == ("invalid", "sha256")
    for f in m.files:
        status, _, _ = await call("PUT", f"{base}/blobs/{f.sha256}", write, data=files[f.path])
        assert status == 201
    status, body, _ = await call("GET", f"{base}/checkpoints/acme/job-1/latest", read)
    assert status == 404
    status, body, _ = await call("PUT", f"{base}/checkpoints/acme/job-1/1", read, json=body_ckpt)
    assert status == 403
    status, body, _ = await call("PUT", f"{base}/checkpoints/acme/job-1/x", write, json=body_ckpt)
    assert status == 400 and error_of(body) == ("invalid", "seq")
    status, body, _ = await call("PUT", f"{base}/checkpoints/acme/job-1/1", write, json=body_ckpt)
    assert status == 201 and body["seq"] == 1 and body["step"] == 7
    assert body["digest"] == m.digest and body["site"] == "site-d"
    status, body, _ = await call("GET", f"{base}/checkpoints/acme/job-1/latest", read)
    assert status == 200 and body["manifest"] == m.model_dump(mode="json")
    # the job's checkpoint grant reads its objects, not another job's
    status, body, _ = await call("GET", f"{base}/objects/{m.digest}/model.pt", read)
    assert status == 200 and body == files["model.pt"]
    other = grant(peer.key, "site-d", "ckpt:acme/job-2")
    status, _, _ = await call("GET", f"{base}/objects/{m.digest}/model.pt", other)
    assert status == 403
    status, _, _ = await call("GET", f"{base}/checkpoints/acme/job-1/latest", other)
    assert status == 403
    # the same checkpoint again (a lost answer): answered as before; another one at that seq
    # is refused, naming seq
    status, body, _ = await call("PUT", f"{base}/checkpoints/acme/job-1/1", write, json=body_ckpt)
    assert status == 201 and body["seq"] == 1
    other_ckpt = {**body_ckpt, "manifest": manifest_of({"step": b"8"}).model_dump()}
    status, body, _ = await call("PUT", f"{base}/checkpoints/acme/job-1/1", write, json=other_ckpt)
    assert status == 409 and error_of(body) == ("conflict", "seq")


def test_forged_claims_model_refuses_unknown_scope() -> None:
    with pytest.raises(ValueError, match="unknown scope"):
        mint("k" * 40, Claims(site="a", sub="b", scope="everything", op="read", exp=0))
