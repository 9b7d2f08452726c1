"""routing.gateway.openai: the body's routing facts, OpenAI's error shape, and usage read from
answers as they pass (whole and streamed, split anywhere)."""

from __future__ import annotations

import json

import pytest

from routing.gateway.openai import (
    BadRequest,
    Meter,
    Usage,
    body_for,
    error_body,
    openai_kind,
    prompt_estimate,
    read_request,
)


def _chunk(content: str | None, usage: object = "absent") -> bytes:
    doc: dict[str, object] = {"id": "c1", "object": "chat.completion.chunk"}
    doc["choices"] = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    if usage != "absent":
        doc["usage"] = usage
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
         "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip


def _stream_with_usage() -> bytes:
    body = b"".join(_chunk(word, None) for word in ("a", "b", "c"))
    return body + _chunk(None, USAGE) + b"data: [DONE]\n\n"


def test_kinds_of_paths() -> None:
    assert openai_kind(b"v1/chat/completions") == "chat"
    assert openai_kind(b"v1/completions?x=1") == "completions"
    assert openai_kind(b"v1/embeddings/") == "embeddings"
    assert openai_kind(b"v1/models") is None and openai_kind(b"generate") is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"{}", "model"),
        (b'{"model": ""}', "model"),
        (b'{"model": 3}', "model"),
        (b'{"model": "m", "stream": "yes"}', "stream"),
        (b'{"model": "m", "stream": true, "stream_options": 1}', "stream_options"),
        (b'{"model": "m", "priority": "high"}', "priority"),
        (b'{"model": "m", "priority": true}', "priority"),
    ],
)
def test_a_body_that_cannot_be_routed_names_its_field(body: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as caught:
        read_request(body, "chat")
    assert caught.value.param == param


def test_include_usage_is_asked_for_a_stream_that_did_not() -> None:
    raw = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    request = read_request(raw, "chat")
    assert request.stream and request.strip_usage
    sent = json.loads(body_for(request, raw, server_priority=None))
    assert sent["stream_options"] == {"include_usage": True}
    asked = b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}'
    request = read_request(asked, "chat")
    assert not request.strip_usage
    assert body_for(request, asked, server_priority=None) is asked  # untouched bytes
    plain = b'{"model":"m"}'
    assert body_for(read_request(plain, "chat"), plain, server_priority=None) is plain


def test_priority_is_removed_or_set_for_the_server() -> None:
    raw = b'{"model":"m","priority":5}'
    assert "priority" not in json.loads(
        body_for(read_request(raw, "chat"), raw, server_priority=None)
    )
    sent = json.loads(body_for(read_request(raw, "chat"), raw, server_priority=-3))
    assert sent["priority"] == -3


def test_prompt_estimate_grows_with_the_prompt() -> None:
    short = read_request(b'{"model":"m","prompt":"hi"}', "completions")
    long = read_request(json.dumps({"model": "m", "prompt": "word " * 400}).encode(), "completions")
    assert 1 <= prompt_estimate(short) < prompt_estimate(long)


def test_error_body_is_openais_shape() -> None:
    error = json.loads(error_body(404, "model_not_found", "no such model", "model"))["error"]
    assert error == {"message": "no such model", "type": "invalid_request_error",
                     "param": "model", "code": "model_not_found"}  # fmt: skip
    assert json.loads(error_body(429, "budget_exhausted", "x", None))["error"]["type"] == (
        "insufficient_quota"
    )
    assert json.loads(error_body(429, "rate_limited", "x", None))["error"]["type"] == (
        "rate_limit_error"
    )
    assert json.loads(error_body(502, "upstream_error", "x", None))["error"]["type"] == (
        "server_error"
    )


def test_usage_of_a_whole_answer() -> None:
    meter = Meter(strip=False)
    meter.whole(json.dumps({"choices": [], "usage": USAGE}).encode())
    assert meter.usage == Usage(7, 3, 4)
    nothing = Meter(strip=False)
    nothing.whole(b"not json")
    assert nothing.usage is None


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 7, "completion_tokens": 3}, Usage(7, 3, 0)),
        ({"completion_tokens": 3, "prompt_tokens": 7, "prompt_tokens_details": None},
         Usage(7, 3, 0)),
        ({"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": None}, Usage(7, 0, 0)),
        ({"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 9},
          "completion_tokens": 3}, Usage(7, 3, 7)),
        ({"prompt_tokens": -5, "completion_tokens": 3}, Usage(0, 3, 0)),
        ({"prompt_tokens": 7.5, "completion_tokens": 3}, None),
        ({"prompt_tokens": 12345678901234567, "completion_tokens": 1},
         Usage(12345678901234567, 1, 0)),
        ({"completion_tokens": 3}, None),
        ("7 tokens", None),
    ],
)  # fmt: skip
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_usage_is_read_as_json_would_read_it(
    usage: object, expected: Usage | None, separators: tuple[str, str]
) -> None:
    """The usage read without a JSON parse where it can be, else parsed: the same numbers."""
    text = 'the "usage": {"prompt_tokens": 1} in a reply'  # escaped in JSON: not a key
    doc = {"id": "x", "choices": [{"text": text}], "usage": usage}
    meter = Meter(strip=False)
    meter.whole(json.dumps(doc, separators=separators).encode())
    assert meter.usage == expected


@pytest.mark.parametrize("cut", [1, 5, 17, 64, 1000])
def test_a_stream_the_client_asked_usage_for_passes_unchanged(cut: int) -> None:
    stream = _stream_with_usage()
    meter = Meter(strip=False)
    out = b"".join(meter.feed(stream[i : i + cut]) for i in range(0, len(stream), cut))
    out += meter.end()
    assert out == stream
    assert meter.usage == Usage(7, 3, 4) and meter.chunks == 3


@pytest.mark.parametrize("cut", [1, 3, 40, 1000])
def test_usage_the_gateway_asked_for_is_taken_back_out(cut: int) -> None:
    stream = _stream_with_usage()
    meter = Meter(strip=True)
    out = b"".join(meter.feed(stream[i : i + cut]) for i in range(0, len(stream), cut))
    out += meter.end()
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    docs = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert [d["choices"][0]["delta"]["content"] for d in docs] == ["a", "b", "c"]
    assert all("usage" not in d for d in docs)
    assert meter.usage == Usage(7, 3, 4) and meter.chunks == 3


def test_a_stream_cut_short_counts_what_went_out() -> None:
    meter = Meter(strip=True)
    sent = meter.feed(_chunk("a", None) + _chunk("b", None)[:10])
    assert sent.count(b"data: ") == 1 and meter.chunks == 1 and meter.usage is None


def test_the_model_is_renamed_as_its_server_serves_it() -> None:
    raw = b'{"model":"chat","messages":[]}'
    request = read_request(raw, "chat")
    sent = json.loads(body_for(request, raw, server_priority=None, model="qwen2.5-7b-instruct"))
    assert sent["model"] == "qwen2.5-7b-instruct"
    same = b'{"model":"qwen2.5-7b-instruct"}'
    kept = body_for(read_request(same, "chat"), same, server_priority=None, model=None)
    assert kept is same


def test_with_metering_off_a_stream_goes_as_it_came() -> None:
    raw = b'{"model":"m","stream":true,"messages":[]}'
    request = read_request(raw, "chat", ask_usage=False)
    assert request.stream and not request.strip_usage
    assert body_for(request, raw, server_priority=None) is raw


@pytest.mark.parametrize("cut", [1, 3, 40, 1000])
def test_a_tracking_meter_stores_its_count_before_the_events_go_out(cut: int) -> None:
    """Meter.track: the delivered count is in the ledger's word before feed returns the events
    it counts (write-ahead), and the usage chunk the gateway takes out is not counted."""
    stream = _stream_with_usage()
    words = memoryview(bytearray(8 * 4)).cast("q")
    meter = Meter(strip=True)
    meter.track(words, 2)
    assert meter.tracking and words[2] == 0
    sent = 0
    for i in range(0, len(stream), cut):
        out = meter.feed(stream[i : i + cut])
        sent += out.count(b'"choices":[{')
        assert words[2] >= sent  # never behind what went out
    meter.end()
    assert words[2] == meter.chunks == 3 and list(words) == [0, 0, 3, 0]
    words.release()  # the ledger unmapped: the meter counts on, storing nowhere
    meter.feed(_chunk("d", None))
    assert meter.chunks == 4 and not meter.tracking


def test_each_servers_way_of_writing_a_null_usage_is_taken_out() -> None:
    for spaced in (False, True):
        doc = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}], "usage": None}
        sep = (", ", ": ") if spaced else (",", ":")
        event = b"data: " + json.dumps(doc, separators=sep).encode() + b"\n\n"
        meter = Meter(strip=True)
        for _ in range(3):
            out = meter.feed(event)
            assert b"usage" not in out and json.loads(out[len(b"data: ") :])["choices"]
        assert meter.chunks == 3


@pytest.mark.parametrize("spaced", [False, True])
def test_null_usages_of_several_events_read_at_once_are_taken_out(spaced: bool) -> None:
    doc = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}], "usage": None}
    sep = (", ", ": ") if spaced else (",", ":")
    block = (b"data: " + json.dumps(doc, separators=sep).encode() + b"\n\n") * 4
    stripped = Meter(strip=True)
    out = stripped.feed(block)
    assert b"usage" not in out and out.count(b"\n\n") == 4 and stripped.chunks == 4
    assert all(json.loads(e[len(b"data: ") :])["choices"] for e in out.split(b"\n\n") if e)
    kept = Meter(strip=False)
    assert kept.feed(block) == block and kept.chunks == 4


@pytest.mark.parametrize("strip", [False, True])
def test_usage_anywhere_in_an_event_or_as_a_word_is_handled(strip: bool) -> None:
    """The look from an event's end finds its usage only where vLLM writes it (last): a null
    usage first, or the word "usage" as the content, go the general way, with the same result."""
    events = [
        b'data: {"usage":null,"id":"c","choices":[{"index":0,"delta":{"content":"usage"}}]}\n\n',
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"usage"}}],"usage":null}\n\n',
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"usage"}}]}\n\n',
    ]
    meter = Meter(strip=strip)
    for event in events:
        out = meter.feed(event)
        doc = json.loads(out[len(b"data: ") :])
        assert doc["choices"][0]["delta"]["content"] == "usage"
        assert ("usage" in doc) == (not strip and b'"usage":null' in event)
    assert meter.chunks == 3 and meter.usage is None


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","stream":true,"messages":[]}',  # spliced: a new first member
        b'{"model":"m","stream":true,"stream_options":null}',  # re-encoded: one member only
        b'{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true}}',
        b' {"model":"m","stream":true}',
    ],
)
def test_include_usage_reaches_the_server_whatever_the_body_had(raw: bytes) -> None:
    request = read_request(raw, "chat")
    sent = body_for(request, raw, server_priority=None)
    assert sent.count(b'"stream_options"') == 1
    doc = json.loads(sent)
    assert doc["stream_options"]["include_usage"] is True and doc["model"] == "m"
    renamed = json.loads(body_for(request, raw, server_priority=None, model="served"))
    assert renamed["stream_options"]["include_usage"] is True and renamed["model"] == "served"
