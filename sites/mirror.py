"""A live copy of one registry prefix: list once, then follow a watch; re-list when it breaks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from sites.errors import RegistryError
from sites.registry import Registry

log = logging.getLogger(__name__)

KeyValues = Sequence[tuple[str, bytes, int]]  # (key, value, mod_revision)


class PrefixMirror:
    """`items` holds key -> value for every key under `prefix`, kept current by a watch.

    Two ways to follow it:

    - `on_change(items)` after the initial list and after every event (the whole mapping);
    - `on_reset(kvs)` after every (re-)list with everything under the prefix, then
      `on_event(key, value or None for a delete, mod_revision)` per change: a consumer that
      keeps its own decoded state (broker.view) applies each change to what it changes, and
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
        while True:
            try:
                await self._follow()
            except RegistryError as exc:
                log.warning(
                    "mirror of %s: %s; re-listing in %.1fs", self.prefix, exc, self._retry_s
                )
                await asyncio.sleep(self._retry_s)

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
