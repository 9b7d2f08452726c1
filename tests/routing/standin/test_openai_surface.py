"""The stand-in's OpenAI surface as vLLM's: usage, include_usage streams, embeddings, /v1/models,
model names and LoRA adapters, vLLM V1's metric names.

Real HTTP on loopback (in-process servers, tests/routing/standin/conftest.py), read with
aiohttp for the exact wire and with the real `openai` client where a client's view matters.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from routing.standin import server as modelserver
from routing.standin.tokens import REPLY_PRIMING, TOKENS_PER_MESSAGE
from tests.routing.standin.conftest import MakeServer


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], status: int = 200
) -> dict[str, Any]:
    async with http.post(url, json=body) as resp:
        text = await resp.text()
        assert resp.status == status, text
        result: dict[str, Any] = json.loads(text)
        return result


async def sse(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """The events of a stream, parsed (the last is the string "[DONE]")."""
    async with http.post(url, json=body) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]] + ["[DONE]"]


async def metric_samples(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/metrics") as resp:
        families = text_string_to_metric_families(await resp.text())
        return {f.name: f for f in families}


async def test_usage_counts_the_prompt_and_the_completion(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server()
    body = await post(http, url + "/v1/completions", {"prompt": "abcd" * 10, "max_tokens": 3})
    # 40 characters at 4 a token; a list of token ids counts one each
    assert body["usage"] == {
        "prompt_tokens": 10,
        "total_tokens": 13,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
    }
    ids = await post(http, url + "/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 2})
    assert ids["usage"]["prompt_tokens"] == 5
    batch = {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 1}
    assert (await post(http, url + "/v1/completions", batch))["usage"]["prompt_tokens"] == 5
    messages = [
        {"role": "system", "content": "x" * 8},
        {"role": "user", "content": [{"type": "text", "text": "y" * 12}]},
    ]
    chat = await post(
        http, url + "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 4}
    )
    # every message's content plus the template's tokens per message and the reply's priming
    assert chat["usage"]["prompt_tokens"] == 2 + 3 + 2 * TOKENS_PER_MESSAGE + REPLY_PRIMING
    assert chat["usage"]["completion_tokens"] == 4
    assert chat["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3"


async def test_a_prefix_hit_reports_cached_tokens_in_whole_blocks(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server(prefix_chars=256, kv_block_tokens=16)
    body = {"prompt": "a" * 400, "max_tokens": 2}  # 100 tokens, a prefix of 64
    cold = await post(http, url + "/v1/completions", body)
    warm = await post(http, url + "/v1/completions", body)
    assert cold["usage"]["prompt_tokens_details"] is None
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    short = {"prompt": "a" * 40, "max_tokens": 2}  # 10 tokens: less than a block
    await post(http, url + "/v1/completions", short)
    again = await post(http, url + "/v1/completions", short)
    assert again["cpn"]["prefix_hit"] and again["usage"]["prompt_tokens_details"] is None
    fams = await metric_samples(http, url)

    def total(name: str) -> float:
        return sum(s.value for s in fams[name].samples if s.name.endswith("_total"))

    assert total("vllm:prefix_cache_queries") == 100 + 100 + 10 + 10  # tokens looked up
    assert total("vllm:prefix_cache_hits") == 64  # tokens found
    assert total("vllm:prompt_tokens") == 220
    assert total("vllm:generation_tokens") == 8


@pytest.mark.parametrize("chat", [True, False])
async def test_include_usage_ends_the_stream_with_a_usage_chunk(
    make_server: MakeServer, http: aiohttp.ClientSession, chat: bool
) -> None:
    url, _ = await make_server(name="qwen")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "abcd" * 4}]} if chat else {"prompt": "ab" * 8}
    )
    body = {**prompt, "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    events = await sse(http, url + path, body)
    *chunks, last, done = events
    assert done == "[DONE]" and len(chunks) == 3
    assert all("usage" in c and c["usage"] is None for c in chunks)
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    prompt_tokens = 4 + TOKENS_PER_MESSAGE + REPLY_PRIMING if chat else 4
    assert last == {
        "id": chunks[0]["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": chunks[0]["created"],
        "model": "qwen",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + 3,
            "completion_tokens": 3,
            "prompt_tokens_details": None,
        },
    }
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "tok0 "}
    # without include_usage: no usage anywhere, as vLLM
    plain = await sse(http, url + path, {**prompt, "stream": True, "max_tokens": 3})
    assert len(plain) == 4 and not any("usage" in c for c in plain[:-1])
    off = {**body, "stream_options": {"include_usage": False}}
    assert not any("usage" in c for c in (await sse(http, url + path, off))[:-1])


async def test_continuous_usage_stats_and_stream_options_without_stream(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server()
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "abcd", "stream": True, "max_tokens": 3, "stream_options": options}
    events = await sse(http, url + "/v1/completions", body)
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 3]
    error = await post(
        http, url + "/v1/completions", {"prompt": "x", "stream_options": options}, status=400
    )
    assert error["error"]["param"] == "stream_options"


async def test_the_openai_client_sees_usage_and_streams(make_server: MakeServer) -> None:
    openai = pytest.importorskip("openai")
    url, _ = await make_server(name="qwen")
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        answer = await client.chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": "hello there"}], max_tokens=2
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 2
        assert answer.usage.prompt_tokens == 3 + TOKENS_PER_MESSAGE + REPLY_PRIMING
        stream = await client.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert [c.usage is None for c in chunks] == [True, True, False]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.total_tokens == answer.usage.total_tokens
        text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
        assert text == "tok0 tok1 "
    finally:
        await client.close()


async def test_embeddings_in_openais_shape_float_and_base64(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, server = await make_server(name="embed", embedding_dim=64)
    body = await post(http, url + "/v1/embeddings", {"input": ["abcd" * 2, "xyz"]})
    assert (body["object"], body["model"]) == ("list", "embed")
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    first, second = body["data"]
    assert (first["object"], first["index"], second["index"]) == ("embedding", 0, 1)
    assert len(first["embedding"]) == 64
    assert math.isclose(math.fsum(x * x for x in first["embedding"]), 1.0, rel_tol=1e-5)
    assert first["embedding"] != second["embedding"]
    again = await post(http, url + "/v1/embeddings", {"input": "abcd" * 2})
    assert again["data"][0]["embedding"] == first["embedding"]  # deterministic
    packed = await post(
        http, url + "/v1/embeddings", {"input": "abcd" * 2, "encoding_format": "base64"}
    )
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack("<64f", raw)) == first["embedding"]  # float32 little-endian
    short = await post(http, url + "/v1/embeddings", {"input": [[1, 2, 3]], "dimensions": 8})
    assert len(short["data"][0]["embedding"]) == 8 and short["usage"]["prompt_tokens"] == 3
    assert server.stats()["served"] == 4


async def test_the_openai_client_decodes_the_stand_ins_embeddings(
    make_server: MakeServer,
) -> None:
    openai = pytest.importorskip("openai")
    url, _ = await make_server(name="embed", embedding_dim=32)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        # the client asks for base64 unless told otherwise, and decodes it to floats
        default = await client.embeddings.create(model="embed", input=["one", "two"])
        floats = await client.embeddings.create(
            model="embed", input=["one", "two"], encoding_format="float"
        )
        shortened = await client.embeddings.create(model="embed", input="one", dimensions=4)
    finally:
        await client.close()
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    assert len(default.data[0].embedding) == 32 and default.usage.prompt_tokens == 2
    assert len(shortened.data[0].embedding) == 4


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": ["a", [1]]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": "a", "encoding_format": "bytes16"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 10_000}, "dimensions"),
        ({"input": "a", "model": 7}, "model"),
    ],
)
async def test_bad_embeddings_are_400s_in_vllms_shape(
    make_server: MakeServer, http: aiohttp.ClientSession, body: dict[str, Any], param: str
) -> None:
    url, _ = await make_server()
    error = (await post(http, url + "/v1/embeddings", body, status=400))["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert (error["code"], error["type"], error["param"]) == (400, "BadRequestError", param)


async def test_models_lists_the_model_and_its_adapters(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server(
        name="bj/chat",
        served_model_name="qwen2.5-7b",
        lora_adapters=[{"name": "sql", "path": "/adapters/sql"}, {"name": "tone", "path": "tone"}],
        max_model_len=8192,
    )
    async with http.get(url + "/v1/models") as resp:
        listing = await resp.json()
    assert listing["object"] == "list"
    cards = {c["id"]: c for c in listing["data"]}
    assert list(cards) == ["qwen2.5-7b", "sql", "tone"]
    base, sql = cards["qwen2.5-7b"], cards["sql"]
    assert (base["object"], base["owned_by"], base["root"], base["parent"]) == (
        "model", "vllm", "qwen2.5-7b", None,
    )  # fmt: skip
    assert (sql["root"], sql["parent"], sql["max_model_len"]) == (
        "/adapters/sql",
        "qwen2.5-7b",
        8192,
    )
    assert sql["permission"][0]["object"] == "model_permission"
    async with http.get(url + "/v1/models/sql") as resp:
        assert resp.status == 200 and (await resp.json())["id"] == "sql"
    async with http.get(url + "/v1/models/nope") as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert (error["code"], error["type"]) == (404, "NotFoundError")
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        ids = [m.id async for m in client.models.list()]
        card = await client.models.retrieve("tone")
    finally:
        await client.close()
    assert ids == ["qwen2.5-7b", "sql", "tone"] and card.owned_by == "vllm"


async def test_a_request_names_the_model_an_adapter_or_nothing(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server(
        served_model_name="qwen", lora_adapters=[{"name": "sql", "path": "p"}]
    )
    completions = url + "/v1/completions"
    assert (await post(http, completions, {"prompt": "x"}))["model"] == "qwen"
    assert (await post(http, completions, {"prompt": "x", "model": "qwen"}))["model"] == "qwen"
    assert (await post(http, completions, {"prompt": "x", "model": "sql"}))["model"] == "sql"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        error = (await post(http, url + path, {"input": "x", "model": "llama"}, 404))["error"]
        assert error == {
            "message": "The model `llama` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
            "field": "model",
        }
    # without --served-model-name the stand-in answers any name as its own (as it always has)
    lax, _ = await make_server(name="old")
    assert (await post(http, lax + "/v1/completions", {"model": "anything"}))["model"] == "old"


async def test_lora_requests_info_names_running_and_waiting_adapters(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server(
        median_ms=400,
        p99_ms=400,
        max_concurrency=1,
        lora_adapters=[{"name": "sql", "path": "p"}, {"name": "tone", "path": "q"}],
        max_loras=2,
    )
    running = asyncio.create_task(post(http, url + "/v1/completions", {"model": "sql"}))
    await asyncio.sleep(0.05)
    waiting = asyncio.create_task(post(http, url + "/v1/completions", {"model": "tone"}))
    await asyncio.sleep(0.05)
    fams = await metric_samples(http, url)
    assert fams["vllm:lora_requests_info"].type == "gauge"
    (sample,) = fams["vllm:lora_requests_info"].samples
    assert sample.labels == {
        "max_lora": "2",
        "running_lora_adapters": "sql",
        "waiting_lora_adapters": "tone",
    }
    assert sample.value > 1.7e9  # vLLM sets it to the time
    await asyncio.gather(running, waiting)
    (idle,) = (await metric_samples(http, url))["vllm:lora_requests_info"].samples
    assert (idle.labels["running_lora_adapters"], idle.labels["waiting_lora_adapters"]) == ("", "")
    plain, _ = await make_server()
    assert "vllm:lora_requests_info" not in await metric_samples(http, plain)  # no LoRA: none


async def test_a_prompt_beyond_the_context_length_is_a_400(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server(max_model_len=100)
    error = await post(
        http, url + "/v1/completions", {"prompt": "a" * 392, "max_tokens": 4}, status=400
    )  # 98 + 4 tokens
    assert error["error"]["param"] == "prompt"
    assert "maximum context length is 100 tokens" in error["error"]["message"]
    await post(http, url + "/v1/completions", {"prompt": "a" * 384, "max_tokens": 4})


def test_cli_takes_adapters_and_refuses_a_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    need = ["--listen", "127.0.0.1:0", "--name", "x", "--median-ms", "1", "--p99-ms", "2"]
    need += ["--max-concurrency", "1", "--served-model-name", "qwen"]
    args = modelserver._parser().parse_args(
        [*need, "--lora-modules", "sql=/a/sql", "tone", "--lora", "more"]
    )
    assert args.lora_modules == ["sql=/a/sql", "tone", "more"]
    for bad in ("a,b", "qwen"):  # a comma (the metric's separator), the model's own name
        assert modelserver.main([*need, "--lora-modules", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "lora_adapters" in err[0], err
