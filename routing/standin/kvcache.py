"""The stand-in model server's caches, modelled (no model runs): KV blocks and a prefix cache.

KvCache: each running request holds ceil((prompt_tokens + max_tokens) / block_tokens) blocks of
a fixed capacity from admission to its last token; usage = held / capacity, capped at 1 (the
stand-in's concurrency limit, not the cache, decides admission: it reports saturation, as
vllm:kv_cache_usage_perc does, for the router to read).

PrefixCache: an LRU of prefix keys (a hash of the prompt's first `chars` characters, see
prompt_text). A request whose key is present was preceded by one with the same prefix, whose
KV blocks a real server would still hold: its prefill is discounted. Keys go in once a prefill
is done, and the oldest go out past `entries`.

Token counts come from routing.standin.tokens (no tokenizer runs).
"""

from __future__ import annotations

import collections
import hashlib
import math
from typing import Any

__all__ = ["KvCache", "PrefixCache", "prompt_text"]


def prompt_text(body: dict[str, Any], *, chat: bool) -> str:
    """The prompt as one string, for the prefix key: chat `messages` (role: content per line),
    else `prompt` (token ids as decimal numbers); "" when absent. The body was validated
    (routing.standin.tokens counted it)."""
    if chat:
        return "\n".join(
            f"{msg.get('role', '')}: {_text(msg.get('content'))}"
            for msg in body.get("messages", [])
        )
    return _text(body.get("prompt", ""))


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(_text(v) for v in value)
    if isinstance(value, dict):
        text = value.get("text")
        if isinstance(text, str):
            return text  # a content part
    return str(value)


class KvCache:
    def __init__(self, *, capacity_blocks: int, block_tokens: int) -> None:
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self.held = 0

    def blocks(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_tokens))

    def hold(self, tokens: int) -> int:
        """Hold the blocks of a request of `tokens` (prompt + output); returns them for release."""
        n = self.blocks(tokens)
        self.held += n
        return n

    def release(self, blocks: int) -> None:
        self.held -= blocks

    @property
    def usage(self) -> float:
        return min(1.0, self.held / self.capacity)


class PrefixCache:
    def __init__(self, *, chars: int, entries: int) -> None:
        self.chars = chars
        self.entries = entries
        self._keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.queries = 0
        self.hits = 0

    def key(self, text: str) -> bytes:
        return hashlib.blake2b(text[: self.chars].encode(), digest_size=16).digest()

    def lookup(self, key: bytes) -> bool:
        """Whether a recent request had this prefix (and counts it)."""
        self.queries += 1
        if key in self._keys:
            self._keys.move_to_end(key)
            self.hits += 1
            return True
        return False

    def store(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.entries:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)
