"""Pulling an object from its replicas: HTTP range requests over the agents' own /data routes,
checked file by file against the manifest (docs/agent.md, "Staging").

Why not rclone: the files are addressed by content and checked by sha256 against a manifest
the broker signed off, the grants are per object and per site, and resuming is one Range
header; the agents' own endpoints do all of it with the aiohttp client the agent has anyway.

- One transfer per digest at a time (`Stager.stage` shares it with every caller that asks
  meanwhile); an object already complete here is a cache hit: nothing moves.
- The manifest is read from the first source that answers, and used only if its digest is the
  one asked for.
- Each missing blob is downloaded into partial/<sha>.part and RESUMED from what is there (the
  part is hashed again first); its sha256 is checked before it becomes a blob.
- A source that serves a file with another sha256 is bad for that file (the part is deleted,
  the next source serves it); one that refuses the grant or has no such object (401, 403,
  404) is dropped; one that cannot be reached (refused, reset, 5xx: it may be restarting) is
  retried with backoff while the others are tried, and dropped once it has failed for
  `retry_window_s`. When every source is dropped, StagingError says why, in one line.
- Bytes pass each source site's token bucket (sites.agent.data.links), and are counted per
  source site as egress (what came over the wire).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import ValidationError

from sites.agent.data.errors import StagingError
from sites.agent.data.links import LinkLimits, Meter
from sites.agent.data.store import DataStore, Kind
from sites.kits.clock import Clock
from sites.kits.tls import PeerTrust, peer_connector
from sites.model.data import Egress, FileEntry, Manifest, Source, StagingProgress

log = logging.getLogger(__name__)

GRANT_HEADER = "X-Cpn-Grant"
SHA_HEADER = "X-Cpn-Sha256"
CHUNK = 64 * 1024
MAX_MANIFEST_BYTES = 32 * 1024 * 1024
RETRY_WINDOW_S = 30.0
BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 3.0

Progress = Callable[[StagingProgress], None]
T = TypeVar("T")


class _Gone(Exception):
    """This source will not serve this item (refused, absent, or served something else)."""


class _Down(Exception):
    """This source could not be reached; `moved`: bytes it sent before (progress was made)."""

    def __init__(self, message: str, moved: int = 0) -> None:
        super().__init__(message)
        self.moved = moved


@dataclass
class _Flight:
    digest: str
    what: str
    listeners: list[Progress]
    task: asyncio.Task[tuple[Path, list[Egress]]] | None = None
    meter: Meter | None = None
    source: str | None = None
    egress: dict[str, int] = field(default_factory=dict)


class Stager:
    """Pulls objects into `store` (module docstring)."""

    def __init__(
        self,
        *,
        store: DataStore,
        clock: Clock,
        limits: LinkLimits,
        parallel_files: int = 16,
        local_host: str | None = None,
        trust: PeerTrust | None = None,
        resolve: Callable[[str], str | None] | None = None,
        retry_window_s: float = RETRY_WINDOW_S,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        report_every_s: float = 0.25,
    ) -> None:
        self.store = store
        self.clock = clock
        self.limits = limits
        self.parallel_files = parallel_files
        # connections leave from the agent's own address, so the WAN emulation (and a real
        # network's policy) sees which site is pulling, as the agent's probes do
        self.local_host = local_host
        # peers' https:// endpoints are verified against it (the federation's CA, `cpn agent
        # --tls-ca`, and its CRL: a pull from a peer it revokes is cut as the CRL loads);
        # None: the system's CAs
        self.trust = trust
        # site -> its agent's URL now: a source that cannot be reached is tried at its new
        # address when its agent came back elsewhere (the grant is signed with its kept key)
        self.resolve = resolve
        self.retry_window_s = retry_window_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.report_every_s = report_every_s
        self._flights: dict[str, _Flight] = {}
        self._blob_locks: dict[str, asyncio.Lock] = {}
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=30)
            connector = peer_connector(
                self.trust, local_addr=None if self.local_host is None else (self.local_host, 0)
            )
            self._session = aiohttp.ClientSession(
                timeout=timeout, auto_decompress=False, connector=connector
            )
        return self._session

    async def close(self) -> None:
        flights = [f.task for f in self._flights.values() if f.task is not None]
        for task in flights:
            task.cancel()
        await asyncio.gather(*flights, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def in_flight(self) -> list[str]:
        return list(self._flights)

    async def stage(
        self,
        digest: str,
        sources: Sequence[Source],
        progress: Progress,
        *,
        what: str = "",
        kind: Kind = "data",
    ) -> tuple[Path, list[Egress]]:
        """The object's tree, complete here, and the bytes pulled per source site for it (none
        for a cache hit, or for a caller that joined a transfer another caller started: the
        egress is counted once). `kind`: a dataset's object (its replica is recorded) or a
        checkpoint's. StagingError when no source could serve it."""
        if self.store.has(digest):
            return self.store.tree(digest), []
        flight = self._flights.get(digest)
        first = flight is None
        if flight is None:
            flight = _Flight(digest=digest, what=what or digest[:12], listeners=[progress])
            flight.task = asyncio.create_task(
                self._stage(flight, tuple(sources), kind), name=f"data stage {digest[:12]}"
            )
            self._flights[digest] = flight
            flight.task.add_done_callback(lambda t: self._landed(digest, t))
        else:
            flight.listeners.append(progress)
            if flight.meter is not None:
                self._report(flight, force=True)
        task = flight.task
        if task is None:  # pragma: no cover - set just above
            raise StagingError(f"staging {digest[:12]} lost its transfer")
        try:
            path, egress = await asyncio.shield(task)
        finally:
            if progress in flight.listeners:
                flight.listeners.remove(progress)
        return path, (egress if first else [])

    def _landed(self, digest: str, task: asyncio.Task[tuple[Path, list[Egress]]]) -> None:
        flight = self._flights.get(digest)
        if flight is not None and flight.task is task:
            del self._flights[digest]
        if not task.cancelled():
            task.exception()  # retrieved here: every caller may have gone

    async def _stage(
        self, flight: _Flight, sources: tuple[Source, ...], kind: Kind
    ) -> tuple[Path, list[Egress]]:
        digest = flight.digest
        if not sources:
            raise StagingError(f"{flight.what} is not held here and has no replica to pull from")
        manifest = await self._try_sources(
            f"the manifest of {flight.what}", sources, lambda s: self._get_manifest(s, digest)
        )
        files: dict[str, FileEntry] = {}
        for f in manifest.files:
            files.setdefault(f.sha256, f)
        with self.store.holding(files):
            meter = Meter(
                total=sum(f.size for f in files.values()),
                clock=self.clock,
                every_s=self.report_every_s,
            )
            flight.meter = meter
            # largest first: the big files keep the link full while the small ones, a round
            # trip each, share what is left (the gate is first come, first served)
            missing = sorted(
                (f for sha, f in files.items() if not self.store.has_blob(sha)),
                key=lambda f: (-f.size, f.path),
            )
            meter.add(meter.total - sum(f.size for f in missing), wire=False)
            self._report(flight, force=True)
            gate = asyncio.Semaphore(self.parallel_files)

            async def one(entry: FileEntry) -> None:
                async with gate:
                    await self._blob(flight, entry, sources)

            tasks = [
                asyncio.create_task(one(f), name=f"data fetch {f.sha256[:12]}") for f in missing
            ]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            path = await asyncio.to_thread(self.store.commit, manifest, kind=kind)
        self._report(flight, force=True)
        egress = [Egress(source=s, bytes=n) for s, n in sorted(flight.egress.items()) if n > 0]
        log.info(
            "staged %s (%s, %d bytes, %d files) pulling %s",
            flight.what, digest[:12], manifest.bytes, len(manifest.files),
            ", ".join(f"{e.bytes} bytes from {e.source}" for e in egress) or "nothing",
        )  # fmt: skip
        return path, egress

    def _report(self, flight: _Flight, *, force: bool = False) -> None:
        meter = flight.meter
        if meter is None or not meter.due(force=force):
            return
        progress = StagingProgress(
            bytes_done=min(meter.done, meter.total),
            bytes_total=meter.total,
            rate_bps=meter.rate_bps(),
            eta_s=meter.eta_s(),
            source=flight.source,
            what=flight.what,
        )
        for listener in list(flight.listeners):
            try:
                listener(progress)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the transfer
                log.exception("a staging progress listener of %s failed", flight.what)

    # -- one item from several sources ---------------------------------------------------

    async def _try_sources(
        self, item: str, sources: Sequence[Source], attempt: Callable[[Source], Awaitable[T]]
    ) -> T:
        """`attempt` each source in turn until one serves `item` (module docstring)."""
        reasons: dict[str, str] = {}
        down_since: dict[int, float] = {}
        dropped: set[int] = set()
        delay = self.backoff_initial_s
        sources = list(sources)
        while True:
            for i, src in enumerate(sources):
                if i in dropped:
                    continue
                try:
                    return await attempt(src)
                except _Gone as exc:
                    dropped.add(i)
                    reasons[src.site] = str(exc)
                except _Down as exc:
                    now = self.clock.monotonic()
                    if exc.moved:
                        down_since.pop(i, None)  # it served something: a new streak
                        delay = self.backoff_initial_s
                    since = down_since.setdefault(i, now)
                    reasons[src.site] = str(exc)
                    moved_to = self.resolve(src.site) if self.resolve is not None else None
                    if moved_to and moved_to != src.url:
                        log.info("source %s is now at %s", src.site, moved_to)
                        sources[i] = src.model_copy(update={"url": moved_to})
                        down_since.pop(i, None)
                        continue
                    if now - since >= self.retry_window_s:
                        dropped.add(i)
                        reasons[src.site] = f"{exc} (for {now - since:.0f}s)"
            if len(dropped) == len(sources):
                why = "; ".join(f"{site}: {reason}" for site, reason in reasons.items())
                raise StagingError(f"no replica could serve {item}: {why}")
            await self.clock.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)

    async def _get_manifest(self, src: Source, digest: str) -> Manifest:
        url = f"{src.url}/data/manifests/{digest}"
        try:
            async with self.session().get(url, headers={GRANT_HEADER: src.grant}) as resp:
                await _check(resp)
                raw = await resp.content.read(MAX_MANIFEST_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _Down(_describe(exc)) from exc
        try:
            manifest = Manifest.model_validate_json(raw)
        except ValidationError as exc:
            raise _Gone("answered a manifest that is not valid") from exc
        if manifest.digest != digest:
            raise _Gone(f"answered a manifest whose digest is {manifest.digest[:12]}")
        return manifest

    async def _blob(self, flight: _Flight, entry: FileEntry, sources: Sequence[Source]) -> None:
        lock = self._blob_locks.setdefault(entry.sha256, asyncio.Lock())
        try:
            async with lock:
                if self.store.has_blob(entry.sha256):
                    return
                await self._try_sources(
                    f"file {entry.path!r} of {flight.what}",
                    sources,
                    lambda s: self._download(flight, entry, s),
                )
        finally:
            if not lock.locked():
                self._blob_locks.pop(entry.sha256, None)

    async def _download(self, flight: _Flight, entry: FileEntry, src: Source) -> None:
        """One try at `entry` from `src`, resuming what partial/ holds of it."""
        meter = flight.meter
        if meter is None:  # pragma: no cover - set before any download
            raise StagingError("no meter")
        part = self.store.part(entry.sha256)
        have, hasher = await asyncio.to_thread(_resume, part, entry.size)
        counted = have
        meter.add(have, wire=False)
        moved = 0
        flight.source = src.site
        try:
            if entry.size == 0:
                part.touch()
            if have < entry.size:
                headers = {GRANT_HEADER: src.grant}
                if have:
                    headers["Range"] = f"bytes={have}-"
                url = f"{src.url}/data/objects/{flight.digest}/{quote(entry.path)}"
                bucket = self.limits.bucket(src.site)
                try:
                    async with self.session().get(url, headers=headers) as resp:
                        await _check(resp)
                        if have and resp.status != 206:  # a whole file: start over
                            meter.add(-have, wire=False)
                            counted = have = 0
                            hasher = hashlib.sha256()
                        elif have and not resp.headers.get("Content-Range", "").startswith(
                            f"bytes {have}-"
                        ):
                            raise _Gone("answered another range than the one asked for")
                        with open(part, "ab" if have else "wb") as out:
                            async for chunk in resp.content.iter_chunked(CHUNK):
                                if bucket is not None:
                                    await bucket.take(len(chunk))
                                if have + len(chunk) > entry.size:
                                    raise _Gone(f"served more than the {entry.size} bytes")
                                out.write(chunk)
                                hasher.update(chunk)
                                have += len(chunk)
                                moved += len(chunk)
                                counted += len(chunk)
                                flight.egress[src.site] = flight.egress.get(src.site, 0) + len(
                                    chunk
                                )
                                meter.add(len(chunk))
                                self._report(flight)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    raise _Down(_describe(exc), moved) from exc
                if have < entry.size:
                    raise _Down(f"sent {have} of {entry.size} bytes", moved)
            sha = hasher.hexdigest()
            if sha != entry.sha256:
                part.unlink(missing_ok=True)
                meter.add(-counted, wire=False)
                counted = 0
                log.warning(
                    "site %s served %r of %s with sha256 %s, not %s: refetching it elsewhere",
                    src.site, entry.path, flight.what, sha[:12], entry.sha256[:12],
                )  # fmt: skip
                raise _Gone(
                    f"served {entry.path!r} with sha256 {sha[:12]}, not {entry.sha256[:12]}"
                )
            await asyncio.to_thread(self.store.adopt, entry.sha256, part)
            counted = 0
        finally:
            if counted:
                meter.add(-counted, wire=False)  # counted again when it resumes


def _resume(part: Path, size: int) -> tuple[int, hashlib._Hash]:
    """How much of the file `part` holds, and the hash of it so far (hashed again: a part is
    trusted for nothing but its length, and its hash is checked at the end)."""
    hasher = hashlib.sha256()
    try:
        have = os.path.getsize(part)
    except FileNotFoundError:
        return 0, hasher
    if have > size:
        part.unlink(missing_ok=True)
        return 0, hasher
    with open(part, "rb") as f:
        while chunk := f.read(1 << 20):
            hasher.update(chunk)
    return have, hasher


async def _check(resp: aiohttp.ClientResponse) -> None:
    """_Gone for an answer that will not change, _Down for one that may (5xx)."""
    if resp.status < 300:
        return
    try:
        body = await resp.json(content_type=None)
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        message = resp.reason or ""
    if resp.status >= 500:
        raise _Down(f"answered {resp.status} {message}".strip())
    raise _Gone(f"answered {resp.status} {message}".strip())


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return f"cannot be reached ({text})"
