"""A live copy of one registry prefix: list once, then follow a watch; re-list when it breaks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from sites.model import keys
from sites.model.errors import RegistryError, RegistryUnavailable
from sites.registry.client import Registry

log = logging.getLogger(__name__)

KeyValues = Sequence[tuple[str, bytes, int]]  # (key, value, mod_revision)

WATCH_STALL_S = 10.0
"""A RootMirror whose watch brought nothing this long while etcd holds newer keys under its
root lists again (RootMirror._stalled)."""


async def _follow_forever(follow: Callable[[], Awaitable[None]], what: str, retry_s: float) -> None:
    """List and watch with `follow` until cancelled; a registry error lists again."""
    while True:
        try:
            await follow()
        except RegistryError as exc:
            log.warning("mirror of %s: %s; re-listing in %.1fs", what, exc, retry_s)
            await asyncio.sleep(retry_s)


class PrefixMirror:
    """`items` holds key -> value for every key under `prefix`, kept current by a watch.

    Two ways to follow it:

    - `on_change(items)` after the initial list and after every event (the whole mapping);
    - `on_reset(kvs)` after every (re-)list with everything under the prefix, then
      `on_event(key, value or None for a delete, mod_revision)` per change: a consumer that
      keeps its own decoded state (broker.state.view) applies each change to what it changes, and
      with keep_items=False the mirror holds no copy of the values at all.
    """

    def __init__(
        self,
        *,
        registry: Registry,
        prefix: str,
        on_change: Callable[[dict[str, bytes]], None] | None = None,
        on_reset: Callable[[KeyValues], None] | None = None,
        on_event: Callable[[str, bytes | None, int], None] | None = None,
        keep_items: bool = True,
        retry_s: float = 1.0,
    ) -> None:
        self.registry = registry
        self.prefix = prefix
        self.items: dict[str, bytes] = {}
        self.revisions: dict[str, int] = {}  # key -> mod_revision, for guarded updates
        self.revision = 0
        self.synced = asyncio.Event()
        self._on_change = on_change
        self._on_reset = on_reset
        self._on_event = on_event
        self._keep = keep_items
        self._retry_s = retry_s

    async def run(self) -> None:
        await _follow_forever(self._follow, self.prefix, self._retry_s)

    async def _follow(self) -> None:
        self.revision, kvs = await self.registry.list_prefix(self.prefix)
        if self._keep:
            self.items = {key: value for key, value, _ in kvs}
            self.revisions = {key: rev for key, _, rev in kvs}
        if self._on_reset is not None:
            self._on_reset(kvs)
        self._changed()
        self.synced.set()
        async for event in self.registry.watch(self.prefix, start_revision=self.revision + 1):
            if self._keep:
                if event.value is None:
                    self.items.pop(event.key, None)
                    self.revisions.pop(event.key, None)
                else:
                    self.items[event.key] = event.value
                    self.revisions[event.key] = event.revision
            self.revision = event.revision
            if self._on_event is not None:
                self._on_event(event.key, event.value, event.revision)
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.items)


APPLY_SLICE = 25
"""Events a RootMirror applies before it lets the event loop run other work (at the next
transaction's start). A watch batch holds whatever came since the last read: at 1,000 sites
publishing every second, a batch that waited behind other work held 300-600 events, and
decoding them in one go stalled every request for 6-15 ms (bench/JOURNAL.md, 2026-12-06,
live_federation.py --stall-log). With 25, and the registry's watch handing over
WATCH_BATCH_EVENTS at a time, the broker's loop was late by more than 20 ms in 0.2-2.4 % of its
50 ms samples (cpn_broker_event_loop_lag_seconds), depending on the host's load."""


class RootMirror:
    """Several prefixes under one root (`keys.ROOT`), each listed, then all followed over ONE
    watch of the root.

    A prefix mirror per prefix meant a watch per prefix, and an agent's publish (its status,
    last_seen and links in one transaction) came as a watch response per prefix it touched:
    each response is a gRPC message read, the largest per-publish cost of a broker following a
    thousand sites publishing every second (bench/JOURNAL.md, 2026-12-05). One watch of
    the root gets one response per transaction. Events under other prefixes of the root are
    skipped by their key's first segment (a dict lookup), before anything is decoded.

    `on_reset(prefix, kvs)` after every (re-)list of a prefix, then `on_event(prefix, key, value
    or None for a delete, mod_revision)` per change under a followed prefix. Each prefix is
    listed at its own revision, and the watch starts after the oldest: an event a prefix's list
    already holds (its revision at or below that list's) is not applied again. A broken watch
    or a compacted revision re-lists every prefix. No value is kept here: the consumer keeps
    what it decoded.
    """

    def __init__(
        self,
        *,
        registry: Registry,
        prefixes: Sequence[str],
        on_reset: Callable[[str, KeyValues], None],
        on_event: Callable[[str, str, bytes | None, int], None],
        root: str = keys.ROOT,
        retry_s: float = 1.0,
        stall_s: float = WATCH_STALL_S,
    ) -> None:
        for prefix in prefixes:
            rest = prefix[len(root) :]
            if not prefix.startswith(root) or rest.find("/") != len(rest) - 1 or len(rest) < 2:
                raise ValueError(f"{prefix!r} is not one segment under {root!r} ('name/')")
        self.registry = registry
        self.root = root
        self.prefixes = tuple(prefixes)
        self.revision = 0
        self.synced = asyncio.Event()
        self.stalls = 0  # watches given up as stalled (stall_s)
        self._on_reset = on_reset
        self._on_event = on_event
        self._retry_s = retry_s
        self._stall_s = stall_s
        self._watching = False
        self._moved_at = time.monotonic()

    async def run(self) -> None:
        await _follow_forever(self._follow_watched, self.root, self._retry_s)

    async def _follow_watched(self) -> None:
        """`_follow`, given up (RegistryUnavailable: listed again) when its watch stalls."""
        follow = asyncio.ensure_future(self._follow())
        stall = asyncio.ensure_future(self._stalled())
        try:
            done, _ = await asyncio.wait((follow, stall), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (follow, stall):
                task.cancel()
            await asyncio.gather(follow, stall, return_exceptions=True)
        if follow in done:
            follow.result()
            return
        self.stalls += 1
        raise RegistryUnavailable(stall.result())

    async def _stalled(self) -> str:
        """Returns (why) once the watch has brought nothing for stall_s while etcd holds keys
        under the root written after the last revision it brought: a watch that is open but
        no longer follows (a 30-minute chaos soak's broker kept a view frozen at the moment
        an etcd member died, its passes deciding on it for minutes: bench/JOURNAL.md,
        2026-12-07, night). PINGs find a peer that is gone, not one that answers and lags."""
        stall_s = self._stall_s
        while True:
            await asyncio.sleep(stall_s / 4)
            quiet = time.monotonic() - self._moved_at
            if not self._watching or quiet < stall_s:
                continue
            seen = self.revision
            try:
                newer = await self.registry.changed_since(self.root, seen)
            except RegistryError:
                continue  # etcd does not answer: the watch's own errors will tell
            if newer and self.revision == seen and self._watching:
                return (
                    f"watch of {self.root} stalled: nothing came for {quiet:.0f}s while etcd "
                    f"holds keys written after revision {seen}"
                )

    async def _follow(self) -> None:
        root, cut = self.root, len(self.root)
        self._watching = False
        # segment ("sites/") -> its prefix and the revision it was listed at
        listed: dict[str, tuple[str, int]] = {}
        for prefix in self.prefixes:
            revision, kvs = await self.registry.list_prefix(prefix)
            self._on_reset(prefix, kvs)
            listed[prefix[cut:]] = (prefix, revision)
        self.revision = min(revision for _, revision in listed.values())
        self.synced.set()
        on_event = self._on_event
        self._moved_at, self._watching = time.monotonic(), True
        async for batch in self.registry.watch_batches(root, start_revision=self.revision + 1):
            self._moved_at = time.monotonic()
            applied, previous = 0, self.revision
            for event in batch:
                if applied >= APPLY_SLICE and event.revision != previous:
                    # between two transactions: what a reader sees meanwhile is a state the
                    # registry was in, as if the batch had come in two
                    self.revision, applied = previous, 0
                    await asyncio.sleep(0)
                previous = event.revision
                key = event.key
                end = key.find("/", cut)
                found = listed.get(key[cut : end + 1] if end > 0 else "")
                if found is None or event.revision <= found[1]:
                    continue  # another prefix of the root, or already in the list
                on_event(found[0], key, event.value, event.revision)
                applied += 1
            self.revision = batch[-1].revision
