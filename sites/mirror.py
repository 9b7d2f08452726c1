"""A live copy of one registry prefix: list once, then follow a watch; re-list when it breaks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sites.errors import RegistryError
from sites.registry import Registry

log = logging.getLogger(__name__)


class PrefixMirror:
    """`items` holds key -> value for every key under `prefix`, kept current by a watch.

    `on_change(items)` is called after the initial list and after every batch of events.
    """

    def __init__(
        self,
        *,
        registry: Registry,
        prefix: str,
        on_change: Callable[[dict[str, bytes]], None] | None = None,
        retry_s: float = 1.0,
    ) -> None:
        self.registry = registry
        self.prefix = prefix
        self.items: dict[str, bytes] = {}
        self.revisions: dict[str, int] = {}  # key -> mod_revision, for guarded updates
        self.revision = 0
        self.synced = asyncio.Event()
        self._on_change = on_change
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
        self.items = {key: value for key, value, _ in kvs}
        self.revisions = {key: rev for key, _, rev in kvs}
        self._changed()
        self.synced.set()
        async for event in self.registry.watch(self.prefix, start_revision=self.revision + 1):
            if event.value is None:
                self.items.pop(event.key, None)
                self.revisions.pop(event.key, None)
            else:
                self.items[event.key] = event.value
                self.revisions[event.key] = event.revision
            self.revision = event.revision
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.items)
