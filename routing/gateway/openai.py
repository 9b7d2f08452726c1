"""The OpenAI surface's per-request work in the gateway: the body's model, the error shape,
and the tokens an answer used. Pure: bytes in, bytes and numbers out.

Three things, each on the request's path (docs/openai.md is the long form):

- `read_request(body, kind)`: the JSON body's `model` (what the request is routed by), whether
  it streams, and the body to send on. A stream that did not ask for usage is sent with
  `stream_options.include_usage: true`, so the model server reports the tokens it used (the
  gateway bills them), and the answer's `Meter` takes that extra usage back out. A body's
  `priority` (vLLM's own field) is removed unless the service opted in (`pass_priority`):
  vLLM refuses it unless it runs priority scheduling, and its sense is the reverse of cpn's.
- `error_body(...)`: OpenAI's `{"error": {"message", "type", "param", "code"}}`.
- `Meter`: reads `usage` from a JSON answer, or from a stream's events as they pass
  (server-sent events, `data: {...}` separated by a blank line), and counts the stream's
  chunks that carry choices (about one token each: what reached the client, billed if the
  stream never ends with its usage). For a stream whose usage the gateway asked for on the
  client's behalf (`strip=True`) it forwards what the client asked for, no more: the
  `"usage":null` of each chunk and the last usage chunk (`"choices":[]`) are removed.
  Events are forwarded whole: a read that ends inside one keeps its start until the rest
  arrives.
"""

from __future__ import annotations

import json
from typing import NamedTuple

__all__ = [
    "KINDS",
    "BadRequest",
    "Meter",
    "OpenAIRequest",
    "Usage",
    "error_body",
    "error_type",
    "openai_kind",
    "prompt_estimate",
    "read_request",
    "unknown_model",
]

KINDS: dict[bytes, str] = {
    b"v1/chat/completions": "chat",
    b"v1/completions": "completions",
    b"v1/embeddings": "embeddings",
}
"""The model server paths (as the tail after the gateway's prefix) whose answers carry usage."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_QUOTA_CODES = frozenset({"budget_exhausted", "insufficient_quota"})


def openai_kind(tail: bytes) -> str | None:
    """The kind of a model server path ("v1/chat/completions", with or without a query), or
    None for one that carries no usage."""
    if tail.find(b"?") >= 0:  # not `in`: see _has
        tail = tail.partition(b"?")[0]
    return KINDS.get(tail.rstrip(b"/"))


def error_type(status: int, code: str) -> str:
    """OpenAI's `type` for an error: insufficient_quota for a spent budget, else by status."""
    if code in _QUOTA_CODES:
        return "insufficient_quota"
    found = _TYPES.get(status)
    if found is not None:
        return found
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, code: str, message: str, param: str | None) -> bytes:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": error_type(status, code),
                "param": param,
                "code": code,
            }
        }
    ).encode()


def unknown_model(model: str) -> str:
    """The message of OpenAI's 404 `model_not_found` for `model` (the proxy's and /v1/models')."""
    return f"the model {model!r} does not exist or you do not have access to it"


class BadRequest(Exception):
    """A body the gateway cannot route: 400, naming the field (`param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class OpenAIRequest(NamedTuple):
    model: str
    stream: bool
    strip_usage: bool  # the gateway asked for the stream's usage: take it out of the answer
    priority: int | None  # the body's own `priority` (vLLM's field), if it had one
    doc: dict[str, object]  # the parsed body, to rewrite (`body_for`)
    changed: bool  # doc differs from the body as sent (and from `spliced`)
    size: int  # the body's bytes as sent
    spliced: bytes | None = None  # the body as sent with include_usage put in front: `doc`


def read_request(body: bytes, kind: str, *, ask_usage: bool = True) -> OpenAIRequest:
    """The routing facts of an OpenAI request body; BadRequest when it has none.
    `ask_usage`: a stream that did not ask for its usage is sent asking for it (the gateway
    meters tokens); False (metering off) sends it as it came."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}", None) from None
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object", None)
    model = doc.get("model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("say which model: a non-empty string in the body's `model`", "model")
    stream = doc.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be true or false", "stream")
    changed = strip = False
    spliced: bytes | None = None
    if stream and ask_usage and kind != "embeddings":
        # a new first member when the body has none by that name (a second would win)
        splice = "stream_options" not in doc and body.startswith(b"{")
        options = doc.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise BadRequest("`stream_options` must be an object", "stream_options")
        if options.get("include_usage") is not True:
            doc["stream_options"] = {**options, "include_usage": True}
            strip = True
            if splice:  # no encoding of the whole body: 5 us of 8 per request
                spliced = _INCLUDE_USAGE + body[1:]
            else:
                changed = True
    priority = doc.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise BadRequest("`priority` must be an integer", "priority")
    return OpenAIRequest(model, bool(stream), strip, priority, doc, changed, len(body), spliced)


def body_for(
    request: OpenAIRequest,
    original: bytes,
    *,
    server_priority: int | None,
    model: str | None = None,
) -> bytes:
    """The body sent to the model server: as sent, unless the gateway added include_usage,
    `priority` must go (`server_priority` None) or be set to `server_priority`, or the model
    must be named as the server serves it (`model`: an alias or a service name was sent; a
    model server refuses a name it does not serve)."""
    doc = request.doc
    changed = request.changed
    if model is not None and doc.get("model") != model:
        doc["model"] = model
        changed = True
    if server_priority is None:
        if "priority" in doc:
            del doc["priority"]
            changed = True
    elif doc.get("priority") != server_priority:
        doc["priority"] = server_priority
        changed = True
    if not changed:
        return original if request.spliced is None else request.spliced
    return json.dumps(doc, separators=(",", ":")).encode()


def prompt_estimate(request: OpenAIRequest) -> int:
    """About how many tokens the prompt has, for a stream cut before its usage arrived (billed
    as `counted`): the body's bytes at 4 a token, as tokenizers average on English text and
    code (the body's few other fields are counted too: an estimate, a little high)."""
    return max(1, request.size // 4)


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def _usage_of(value: object) -> Usage | None:
    if not isinstance(value, dict):
        return None
    prompt = value.get("prompt_tokens")
    completion = value.get("completion_tokens", 0)
    if completion is None:
        completion = 0
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    cached = 0
    details = value.get("prompt_tokens_details")
    if isinstance(details, dict):
        got = details.get("cached_tokens")
        if isinstance(got, int):
            cached = got
    return Usage(max(prompt, 0), max(completion, 0), min(max(cached, 0), max(prompt, 0)))


_INCLUDE_USAGE = b'{"stream_options":{"include_usage":true},'
_EVENT_END = b"\n\n"
_USAGE_NULLS = (b',"usage":null', b', "usage": null', b'"usage":null,', b'"usage": null, ')
_USAGE_KEYS = (b'"usage":{', b'"usage": {')
_DECODER = json.JSONDecoder()


def _number_after(data: bytes, key: bytes, start: int) -> int:
    """The whole number after `key` (and its colon) in data[start:]; -1: no key, -2: not a
    plain whole number (null counts as 0)."""
    at = data.find(key, start)
    if at < 0:
        return -1
    i = at + len(key)
    n = len(data)
    while i < n and (data[i] == 58 or data[i] == 32):  # ':' ' '
        i += 1
    if data.startswith(b"null", i):
        return 0
    value = 0
    digits = 0
    while i < n and 48 <= data[i] <= 57:
        value = value * 10 + data[i] - 48
        digits += 1
        i += 1
    if digits == 0 or digits > 15 or (i < n and data[i] not in (44, 32, 125, 10, 13)):
        return -2  # ',' ' ' '}' or a line's end must follow
    return value


def _usage_numbers(data: bytes) -> Usage | None:
    """The usage read without parsing JSON, where servers write it (the answer's last member,
    its numbers plain): None when it is not so (then it is parsed)."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    i = at + 7
    n = len(data)
    while i < n and (data[i] == 58 or data[i] == 32):
        i += 1
    if i >= n or data[i] != 123:  # '{'
        return None
    prompt = _number_after(data, b'"prompt_tokens"', i)
    completion = _number_after(data, b'"completion_tokens"', i)
    cached = _number_after(data, b'"cached_tokens"', i)
    if prompt < 0 or completion == -2 or cached == -2:
        return None
    completion = max(completion, 0)
    return Usage(prompt, completion, min(max(cached, 0), prompt))


def _usage_at(data: bytes) -> Usage | None:
    """The usage object in a JSON text, read alone (the rest of the answer is not): None
    when there is none."""
    found = _usage_numbers(data)
    if found is not None:
        return found
    for key in _USAGE_KEYS:
        at = data.find(key)
        if at >= 0:
            try:
                text = data[at + len(key) - 1 :].decode("utf-8")
                value, _ = _DECODER.raw_decode(text)
            except (ValueError, UnicodeDecodeError):
                return None
            return _usage_of(value)
    return None


class Meter:
    """The usage of one answer, read as it passes (see the module docstring)."""

    __slots__ = ("strip", "usage", "chunks", "_rest", "_usage_null", "_words", "_word")

    def __init__(self, *, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self.chunks = 0  # stream events with choices that went to the client
        self._rest = b""
        self._usage_null = b""  # the server's `"usage":null` as it writes it, once seen
        self._words: memoryview | None = None
        self._word = -1

    def track(self, words: memoryview, word: int) -> None:
        """Store `chunks` into words[word] (the token ledger's write-ahead slot, a mapped
        file) each time it grows, before the events it counts are returned to be sent: a
        broker killed between the two bills a chunk its client may miss, never one it got
        unbilled. Per chunk a store, no call out of the compiled code."""
        self._words = words
        self._word = word
        self._store()

    @property
    def tracking(self) -> bool:
        return self._words is not None

    def _store(self) -> None:
        words = self._words
        if words is not None:
            try:
                words[self._word] = self.chunks
            except ValueError:  # the ledger unmapped (the broker stopping): keep counting
                self._words = None

    def whole(self, body: bytes) -> None:
        """A JSON answer's usage, if it has one."""
        found = _usage_at(body)
        if found is not None:
            self.usage = found

    def feed(self, chunk: bytes) -> bytes:
        """A piece of a stream as read: what to send the client now (maybe b"")."""
        size = len(chunk)
        if not self._rest and size >= 2 and chunk[size - 1] == 10 and chunk[size - 2] == 10:
            return self._events(chunk)  # the common read: whole events, nothing kept
        data = self._rest + chunk if self._rest else chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._rest = data
            return b""
        cut = end + len(_EVENT_END)
        self._rest = data[cut:]
        return self._events(data[:cut])

    def end(self) -> bytes:
        """The stream ended: what is left of it (an event without its blank line)."""
        rest, self._rest = self._rest, b""
        if not rest:
            return b""
        return self._events(rest)

    def _events(self, block: bytes) -> bytes:
        """Whole events: count them, take their usage, and strip what the client did not ask
        for. The common block, one event whose `usage` (its last member, as vLLM and OpenAI
        write it) is null, costs one scan and a look from its end (`"usage"` can only be a key
        or a whole string value: a string's own quotes are escaped); the rest goes through
        `_blocks`, and only a usage event is parsed."""
        n = block.count(b"data: {")
        if n == 0:
            n = block.count(b"data:{")
        if n:
            self.chunks += n
            self._store()
        at = block.rfind(b'"usage"')
        if at < 0:
            return block
        # what follows the key, byte by byte (indexing is native when compiled; a method
        # call per test was most of a chunk's cost): ':', maybe ' ', then null or an object
        size = len(block)
        i = at + 7
        if i + 7 > size or block[i] != 58:  # ":", and room for " null"
            return self._blocks(block)  # "usage" as a value
        i += 1
        if block[i] == 32:  # ' '
            i += 1
        if block[i] == 123:  # '{'
            if n != 1:
                return self._blocks(block)
            return self._usage_event(block, at)
        if block[i] != 110 or block[i + 1] != 117 or block[i + 2] != 108 or block[i + 3] != 108:
            return self._blocks(block)  # not null
        # the block's last usage is null: it holds no usage chunk (that one is the stream's
        # last event with choices or usage), only null usages to strip
        if not self.strip:
            return block
        if n != 1:  # each event's null usage, written as the last one is
            if i == at + 8 and block[at - 1] == 44:
                return block.replace(_USAGE_NULLS[0], b"")
            if i == at + 9 and block[at - 1] == 32 and block[at - 2] == 44:
                return block.replace(_USAGE_NULLS[1], b"")
            return self._blocks(block)
        stop = i + 4
        if block[at - 1] == 44:  # ','
            return block[: at - 1] + block[stop:]
        if block[at - 1] == 32 and block[at - 2] == 44:  # ', '
            return block[: at - 2] + block[stop:]
        return self._blocks(block)  # not after another member: the general way

    def _usage_event(self, block: bytes, at: int) -> bytes:
        """A block with one event, whose usage (at `at`) is an object: the last chunk's
        (`"choices":[]`, maybe with `data: [DONE]` after it), taken out when stripping; else
        the general way."""
        start = block.rfind(b"data:", 0, at)
        stop = block.find(_EVENT_END, at)
        if start < 0 or stop < 0:
            return self._blocks(block)
        if block.find(b'"choices":[]', start, stop) < 0:
            if block.find(b'"choices": []', start, stop) < 0:
                return self._blocks(block)  # usage beside choices (continuous usage stats)
        usage = _usage_at(block[start:stop])
        if usage is not None:
            self.usage = usage
        self.chunks -= 1  # the usage chunk carries no choice
        self._store()
        if not self.strip:
            return block
        return block[:start] + block[stop + len(_EVENT_END) :]

    def _blocks(self, block: bytes) -> bytes:
        """`_events` for any block (its events already counted)."""
        if self.strip:
            null = self._usage_null
            if null:
                block = block.replace(null, b"")
            else:
                for candidate in _USAGE_NULLS:  # a server writes its JSON one way: keep it
                    if _has(block, candidate):
                        self._usage_null = candidate
                        block = block.replace(candidate, b"")
                        break
            if not _has(block, b'"usage"'):
                return block
        if not _has(block, b'"usage":{') and not _has(block, b'"usage": {'):
            return block
        out = []
        for event in block.split(_EVENT_END):
            if not event:
                continue
            if _has(event, b'"usage":{') or _has(event, b'"usage": {'):
                usage = _usage_at(event)
                if usage is not None:
                    self.usage = usage
                if _has(event, b'"choices":[]') or _has(event, b'"choices": []'):
                    self.chunks -= 1  # the usage chunk carries no choice
                    self._store()
                    if self.strip:
                        continue
                elif self.strip:
                    event = _without_usage(event)
            out.append(event)
        if not out:
            return b""
        return _EVENT_END.join(out) + _EVENT_END


def _has(data: bytes, part: bytes) -> bool:
    """`part in data` without its cost: bytes' `in` first tries its operand as an integer,
    and a TypeError is made, formatted and dropped each time (about a microsecond)."""
    return data.find(part) >= 0


def _without_usage(event: bytes) -> bytes:
    """A stream event with its (non-null) usage removed, re-encoded."""
    payload = event.partition(b"data:")[2].strip()
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return event
    if not isinstance(doc, dict):
        return event
    doc.pop("usage", None)
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode()
