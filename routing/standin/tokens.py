"""Token counts for the stand-in's `usage`: a deterministic stand-in for a tokenizer.

No tokenizer runs. Text counts ceil(characters / 4) tokens (CHARS_PER_TOKEN: about what BPE
tokenizers give for English text; an empty text is 0), and token ids count one each. So:

    completions  `prompt` a string: its count; a list of strings: the sum of theirs; a list of
                 token ids: its length; a list of lists of token ids: the sum of their lengths
    chat         every message costs TOKENS_PER_MESSAGE (a ChatML-style template's
                 `<|im_start|>role\\n ... <|im_end|>\\n`), plus its content (a string, or the
                 text of its text parts; any other part, an image say, MEDIA_PART_TOKENS), plus
                 its `name` and its `tool_calls` (as JSON) where present; then REPLY_PRIMING for
                 the assistant turn the template opens (`<|im_start|>assistant\\n`)
    embeddings   each input as a completion's prompt

Cached tokens (`prompt_tokens_details.cached_tokens`) are whole KV blocks of the prompt's
prefix, never the prompt's last token, as vLLM's prefix cache reuses them (cached_tokens).
"""

from __future__ import annotations

import json
import math
from typing import Any

from routing.standin.errors import ApiError

__all__ = [
    "CHARS_PER_TOKEN",
    "MEDIA_PART_TOKENS",
    "REPLY_PRIMING",
    "TOKENS_PER_MESSAGE",
    "cached_tokens",
    "chat_tokens",
    "prompt_tokens",
    "text_tokens",
    "usage",
]

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
REPLY_PRIMING = 3
MEDIA_PART_TOKENS = 64


def text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def prompt_tokens(prompt: object, *, param: str = "prompt") -> int:
    """The tokens of a completion's `prompt` (or an embedding's `input`); ApiError naming
    `param` when it is none of the shapes OpenAI allows."""
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return sum(text_tokens(p) for p in prompt)
        if all(_is_id(p) for p in prompt):
            return len(prompt)
        if all(isinstance(p, list) and all(_is_id(t) for t in p) for p in prompt):
            return sum(len(p) for p in prompt)
    raise ApiError(
        f"{param} must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids",
        param=param,
    )


def chat_tokens(messages: object) -> int:
    """The tokens of a chat's `messages` through the template (module docstring)."""
    if not isinstance(messages, list):
        raise ApiError("messages must be a list of objects", param="messages")
    total = REPLY_PRIMING
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ApiError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        total += TOKENS_PER_MESSAGE + _content_tokens(msg.get("content"), i)
        name = msg.get("name")
        if isinstance(name, str):
            total += text_tokens(name)
        if msg.get("tool_calls"):
            total += text_tokens(json.dumps(msg["tool_calls"], separators=(",", ":")))
    return total


def _content_tokens(content: object, i: int) -> int:
    if content is None:  # an assistant turn with tool calls only
        return 0
    if isinstance(content, str):
        return text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                total += text_tokens(part["text"])
            elif isinstance(part, dict):
                total += MEDIA_PART_TOKENS
            else:
                raise ApiError(
                    f"messages[{i}].content parts must be objects",
                    param=f"messages[{i}].content",
                )
        return total
    raise ApiError(
        f"messages[{i}].content must be a string or a list", param=f"messages[{i}].content"
    )


def cached_tokens(prefix_tokens: int, prompt: int, block_tokens: int) -> int:
    """Tokens a prefix-cache hit saves: the whole blocks of the shared prefix, short of the
    prompt's last token (it is computed again for its logits)."""
    reusable = min(prefix_tokens, prompt - 1)
    return max(0, reusable // block_tokens * block_tokens)


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """vLLM's usage object; `prompt_tokens_details` null unless some of the prompt was cached
    (vLLM with --enable-prompt-tokens-details)."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if cached else None,
    }


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
