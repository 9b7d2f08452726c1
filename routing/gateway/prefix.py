"""The prefix key of an inference request, for prefix-cache affinity (docs/routing.md).

Requests that share a prompt prefix are worth sending to the same site: its model server still
holds the prefix's KV blocks and skips most of the prefill. The proxy computes one key per
request, before routing:

1. the header `X-Cpn-Prefix-Key` when the client sends one (it knows its shared prefix best:
   a system prompt, a document, a conversation id), else
2. from the raw JSON body, without parsing it: the first `chars` bytes after the first
   `"prompt":` or `"messages":` key (whitespace after the colon skipped), hashed. For a chat
   request that is the start of the messages array, i.e. the system prompt and the first turns.

The body is searched in its first MAX_SCAN bytes only, with bytes.find (C), and the hash covers
at most `chars` bytes, so the cost is a few microseconds whatever the body's size. A key found
inside a nested object (a `"prompt":` key that is not the top-level one) is still a fine key:
it is the same for the same bodies. No key (neither field, an empty prompt, or fewer than
`chars` bytes from the field's value to the end of the body: a short prompt has little prefill
to reuse, and sending it further away for a hit would not pay): None, and the request is
routed without affinity.
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_SCAN", "PREFIX_HEADER", "header_key", "prefix_key"]

PREFIX_HEADER = "X-Cpn-Prefix-Key"
MAX_SCAN = 64 * 1024
MAX_HEADER_KEY = 256  # a longer header is hashed as well, so keys stay small
_FIELDS = (b'"prompt"', b'"messages"')
_SPACE = b" \t\r\n"
_COLON = ord(":")


def prefix_key(body: bytes, chars: int) -> str | None:
    """The prefix key of a JSON request body (module docstring), or None."""
    if chars <= 0 or not body:
        return None
    n = min(len(body), MAX_SCAN)
    # the first of the two keys; no copy of the body (find takes bounds)
    at = body.find(_FIELDS[0], 0, n)
    end = n if at < 0 else at
    other = body.find(_FIELDS[1], 0, end)
    if other >= 0:
        at = other + len(_FIELDS[1])
    elif at >= 0:
        at += len(_FIELDS[0])
    else:
        return None
    while at < n and body[at] in _SPACE:
        at += 1
    if at >= n or body[at] != _COLON:
        return None
    at += 1
    while at < n and body[at] in _SPACE:
        at += 1
    value = body[at : at + chars]
    if len(value) < chars or value.startswith((b'""', b"[]", b"null")):
        return None  # a short prompt has little prefill to reuse: no affinity for it
    return "p:" + hashlib.blake2b(value, digest_size=12).hexdigest()


def header_key(value: str) -> str | None:
    """The X-Cpn-Prefix-Key header as a key: stripped, hashed when long; None when empty."""
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_HEADER_KEY:
        return "h:" + hashlib.blake2b(value.encode(), digest_size=12).hexdigest()
    return "h:" + value
