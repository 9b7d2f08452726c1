"""How the registry pages a range read so that no response nears gRPC's message limit.

Pure policy, no I/O: sites.registry.reads asks `next_page_keys` how many keys to request next and
carries the answer out against etcd. docs/registry.md ("Chunked reads") has the long form.

Why a byte budget and not only a key count: etcd's Range has a key `limit` but no byte limit,
and gRPC refuses (client side, RESOURCE_EXHAUSTED) any message over 4 MiB. So the next page's
key count is sized from the largest key-value seen on the page before, to fit in
PAGE_BYTES; a page that still comes back too large (a run of big values after small ones) is
asked again with half the keys. One key always fits: etcd refuses any request over its
`--max-request-bytes` (1.5 MiB by default), so no stored value is larger than that.
"""

from __future__ import annotations

from dataclasses import dataclass

GRPC_MESSAGE_LIMIT_BYTES = 4 * 1024 * 1024
"""gRPC's default largest message a client accepts (bytes); what a page must stay under."""

PAGE_KEYS = 500
"""Most keys asked for in one page (count). At cpn's value sizes (a job record ~1.5 KB, a site
spec a few KB) 500 keys are well under PAGE_BYTES, so the count is what bounds a page."""

PAGE_BYTES = 1024 * 1024
"""Byte budget of one page (bytes): a quarter of GRPC_MESSAGE_LIMIT_BYTES, so an estimate
that is off by a factor of 4 still fits."""

MAX_RESTARTS = 5
"""How often a consistent read restarts (count) when etcd compacted its revision mid-read."""


@dataclass(frozen=True)
class Page:
    """One page of a range read: every item was read at `revision` (etcd's header revision).

    items: (key, value, mod_revision) in key order; more: True when keys follow this page.
    """

    revision: int
    items: list[tuple[str, bytes, int]]
    more: bool


def next_page_keys(*, largest_item_bytes: int, page_keys: int, page_bytes: int = PAGE_BYTES) -> int:
    """Keys to request next, given the largest serialized item of the page before (bytes).

    At least 1, at most `page_keys`; 0 for `largest_item_bytes` means nothing was seen yet.
    """
    if page_keys < 1:
        raise ValueError(f"page_keys: must be at least 1, got {page_keys}")
    if page_bytes < 1:
        raise ValueError(f"page_bytes: must be at least 1, got {page_bytes}")
    if largest_item_bytes <= 0:
        return page_keys
    return max(1, min(page_keys, page_bytes // largest_item_bytes))


def halve(limit: int) -> int | None:
    """The key count to retry a too-large page with, or None when one key already failed."""
    return None if limit <= 1 else limit // 2
