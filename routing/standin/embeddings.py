"""POST /v1/embeddings for the stand-in: deterministic vectors in OpenAI's shape.

`input` is a string, a list of strings, a list of token ids or a list of lists of token ids
(at most MAX_INPUTS; no empty string or list). Each input's vector is drawn from a generator
seeded by a hash of the input, normalised to length 1: the same input gives the same vector,
different inputs unrelated ones. `dimensions` keeps the first that many components,
normalised again (as a Matryoshka model shortens its vectors); at most `embedding_dim`.
`encoding_format` "float" (the default) gives lists of numbers, "base64" the base64 of the
float32 little-endian bytes, what openai-python asks for by default and decodes with
`np.frombuffer(..., dtype="float32")`. The floats are float32 values either way, so both
formats decode to the same numbers.

    {"id": "embd-...", "object": "list", "created": ..., "model": ...,
     "data": [{"object": "embedding", "index": 0, "embedding": [...] | "base64..."}],
     "usage": {"prompt_tokens": N, "total_tokens": N}}
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import random
import struct
import time
import uuid
from typing import Any

from routing.standin.errors import ApiError
from routing.standin.tokens import prompt_tokens

__all__ = ["MAX_INPUTS", "EmbeddingRequest", "vector"]

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs
ENCODINGS = ("float", "base64")


class EmbeddingRequest:
    """A validated embeddings body: its inputs, their tokens, the format and dimensions."""

    def __init__(self, body: dict[str, Any], *, embedding_dim: int, max_model_len: int) -> None:
        self.inputs = _inputs(body.get("input"))
        self.tokens = [prompt_tokens(i, param="input") for i in self.inputs]
        for n in self.tokens:
            if n > max_model_len:
                raise ApiError(
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"you requested {n} tokens in the input for embedding generation. Please "
                    "reduce the length of the input.",
                    param="input",
                )
        encoding = body.get("encoding_format", "float")
        if encoding is None:
            encoding = "float"
        if encoding not in ENCODINGS:
            raise ApiError("encoding_format must be float or base64", param="encoding_format")
        self.encoding: str = encoding
        dims = body.get("dimensions")
        if dims is not None and (
            isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= embedding_dim
        ):
            raise ApiError(
                f"dimensions must be an integer in 1..{embedding_dim}", param="dimensions"
            )
        self.dimensions: int = embedding_dim if dims is None else dims
        self.embedding_dim = embedding_dim

    def response(self, model: str) -> dict[str, Any]:
        data = []
        for index, item in enumerate(self.inputs):
            vec = vector(item, self.embedding_dim, self.dimensions)
            packed = struct.pack(f"<{len(vec)}f", *vec)
            embedding: list[float] | str = (
                base64.b64encode(packed).decode()
                if self.encoding == "base64"
                else list(struct.unpack(f"<{len(vec)}f", packed))
            )
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        total = sum(self.tokens)
        return {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }


def _inputs(value: object) -> list[str | list[int]]:
    """The body's `input` as a list of inputs, one per vector."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        items = [value]  # one input of token ids
    elif isinstance(value, list) and value:
        items = value
    else:
        raise ApiError(
            "input must be a non-empty string, list of strings, list of token ids or list of "
            "lists of token ids",
            param="input",
        )
    if len(items) > MAX_INPUTS:
        raise ApiError(f"input has more than {MAX_INPUTS} items", param="input")
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            continue
        if isinstance(item, list) and item and all(_is_id(t) for t in item):
            continue
        raise ApiError(
            f"input[{i}] must be a non-empty string or a non-empty list of token ids",
            param="input",
        )
    if len({type(item) for item in items}) > 1:
        raise ApiError("input must not mix strings and token ids", param="input")
    return items


def vector(item: str | list[int], embedding_dim: int, dimensions: int) -> list[float]:
    """The unit vector of `item`, its first `dimensions` components renormalised."""
    key = item.encode() if isinstance(item, str) else json.dumps(item).encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    rng = random.Random(seed)
    full = [rng.gauss(0.0, 1.0) for _ in range(embedding_dim)]
    head = full[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
