"""Newest-first reads of an index whose keys are <prefix><position>/<id>, position being
broker.state.store.position (an inverted creation time): the job indexes and the audit log.

A page is read at one etcd revision, carried in its continue token with the position after
which the next page starts (as Kubernetes' continue tokens carry theirs); `Cursor` reads an
index from such a position in time windows (see its docstring for why).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import json
import time
from collections.abc import AsyncGenerator

from broker.model.errors import InvalidRequest
from broker.state.store import position
from sites.registry.client import Registry
from sites.registry.paging import Page

__all__ = ["WINDOW_US", "Cursor", "token", "untoken"]

WINDOW_US = 3600 * 1_000_000
"""The first time window a page reads of the index (microseconds of creation time)."""
_POSITIONS = 10**17


def token(revision: int, after: str) -> str:
    raw = json.dumps({"r": revision, "a": after}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def untoken(token: str) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        revision, after = int(data["r"]), str(data["a"])
    except (binascii.Error, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest("not a continue token of this API", field="continue") from exc
    if revision <= 0 or "/" not in after:
        raise InvalidRequest("not a continue token of this API", field="continue")
    return revision, after


class Cursor:
    """Index entries of one prefix in key order, after `after`, read lazily a page at a time.

    In time windows: etcd 3.5 counts every key left in a range for each page it answers, so a
    page read to the end of a 100,000-key index costs 100,000 key visits. A window starts one
    hour of creation time wide (positions are microseconds) and grows 4x each time it is
    used up, so a page costs what the window holds, and a sparse or old stretch of the index
    is crossed in a few reads.
    """

    def __init__(
        self,
        registry: Registry,
        prefix: str,
        *,
        after: str | None,
        revision: int,
        page_keys: int,
        archived: bool,
    ) -> None:
        self.registry = registry
        self.prefix = prefix
        self.archived = archived
        self.revision = revision
        self.page_keys = page_keys
        self.buffer: list[tuple[str, bytes]] = []  # (suffix after the prefix, value)
        self.done = False
        self._start = prefix if after is None else prefix + after + "\x00"
        self._span = WINDOW_US
        self._pages: AsyncGenerator[Page, None] | None = None
        self._last_window = False
        self._end: str | None = None

    def _open_window(self) -> AsyncGenerator[Page, None]:
        digits = self._start[len(self.prefix) :][:17]
        if len(digits) == 17 and digits.isdigit():
            high = int(digits) + self._span
        else:  # the first page: every job created in the last hour (or dated ahead of now)
            high = int(position(time.time() - WINDOW_US / 1e6))
        self._last_window = high >= _POSITIONS
        self._end = None if self._last_window else f"{self.prefix}{high:017d}"
        return self.registry.iter_range(
            self._start,
            prefix=self.prefix,
            end_key=self._end,
            revision=self.revision,
            page_keys=self.page_keys,
        )

    @property
    def read_to(self) -> str | None:
        """Every entry whose suffix sorts before this one has been read into the buffer (None
        once the index is read to its end): a merge may hand out the others' entries up to
        it without reading this index further."""
        return None if self.done else self._start[len(self.prefix) :]

    async def step(self) -> None:
        """Read on by one page of the current window, or on to the next, wider window."""
        if self.done:
            return
        if self._pages is None:
            self._pages = self._open_window()
        try:
            page = await anext(self._pages)
        except StopAsyncIteration:
            self._pages = None
            if self._last_window:
                self.done = True
            else:  # this window is used up: the next, wider one
                assert self._end is not None
                self._start = self._end
                self._span *= 4
            return
        cut = len(self.prefix)
        self.buffer += [(k[cut:], v) for k, v, _ in page.items]
        if page.items:
            self._start = page.items[-1][0] + "\x00"

    async def fill(self) -> None:
        """Read on until the buffer holds an entry (nothing once the index is read)."""
        while not self.buffer and not self.done:
            await self.step()

    def take(self, bound: str | None) -> list[tuple[str, bytes, bool]]:
        """The buffered entries sorting before `bound` (all when None), removed from the
        buffer."""
        if bound is None:
            n = len(self.buffer)
        else:
            n = bisect.bisect_left(self.buffer, bound, key=lambda e: e[0])
        out = [(k, v, self.archived) for k, v in self.buffer[:n]]
        del self.buffer[:n]
        return out

    async def close(self) -> None:
        if self._pages is not None:
            await self._pages.aclose()
