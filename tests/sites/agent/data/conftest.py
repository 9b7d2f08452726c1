"""Fixtures of the data plane's tests: stores on disk with the real /data routes served on
loopback, standing in for the agents of other sites (real HTTP, real files; no agent process)."""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from sites.agent.data.serve import DataRoutes
from sites.agent.data.store import DataStore
from sites.kits.clock import SystemClock
from sites.model.data import Claims, FileEntry, Manifest, Source, mint

LIMIT = 1 << 30


def manifest_of(files: dict[str, bytes]) -> Manifest:
    return Manifest(
        files=tuple(
            FileEntry(path=p, size=len(b), sha256=hashlib.sha256(b).hexdigest())
            for p, b in files.items()
        )
    )


def put_blobs(store: DataStore, files: dict[str, bytes]) -> Manifest:
    """Write `files` as blobs of `store` and commit them: an object held complete."""
    for data in files.values():
        tmp = store.temp()
        tmp.write_bytes(data)
        store.adopt(hashlib.sha256(data).hexdigest(), tmp)
    manifest = manifest_of(files)
    store.commit(manifest)
    return manifest


def grant(key: str, site: str, scope: str, op: str = "read", exp_s: float = 600) -> str:
    claims = Claims(site=site, sub="tests", scope=scope, op=op, exp=time.time() + exp_s)
    return mint(key, claims)


@dataclass
class Peer:
    """A site's store and its /data routes on 127.0.0.1 (stopped and started on one port)."""

    site: str
    store: DataStore
    key: str
    port: int = 0
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    ranges: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def source(self, scope: str, op: str = "read") -> Source:
        return Source(site=self.site, url=self.url, grant=grant(self.key, self.site, scope, op))

    async def start(self) -> None:
        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            self.requests.append((request.method, request.path))
            self.ranges.append((request.path, request.headers.get("Range")))
            response: web.StreamResponse = await handler(request)
            return response

        app = web.Application(middlewares=[count])
        DataRoutes(store=self.store, site=self.site, key=self.key, clock=SystemClock()).add_to(
            app.router
        )
        self.runner = web.AppRunner(app, shutdown_timeout=0.2, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self, *, kill: bool = False) -> None:
        """Stop serving; `kill`: as a killed process does, its connections reset at once
        (what was in flight is lost)."""
        if self.runner is None:
            return
        if kill and self.runner.server is not None:
            for handler in self.runner.server.connections:
                if handler.transport is not None:
                    handler.transport.abort()
        await self.runner.cleanup()
        self.runner = None


MakePeer = Callable[..., Awaitable[Peer]]


@pytest.fixture
async def make_peer(tmp_path: Path) -> AsyncIterator[MakePeer]:
    peers: list[Peer] = []

    async def make(site: str, *, limit: int = LIMIT, key: str | None = None) -> Peer:
        store = DataStore(tmp_path / site, limit)
        peer = Peer(site=site, store=store, key=key or secrets.token_urlsafe(32))
        await peer.start()
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        await peer.stop()


def corrupt(path: Path) -> None:
    """Flip the first byte of a read-only blob (a disk that went bad)."""
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
