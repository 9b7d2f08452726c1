"""The OpenAI surface at the broker's root (docs/openai.md): what an OpenAI client calls with
the broker's URL as its base URL.

    POST /v1/chat/completions, /v1/completions, /v1/embeddings
        routed by the body's `model` (broker.state.models: a service, a served model, an
        adapter or an alias) through the inference proxy (routing.gateway.proxy), as
        /v1/infer/{service}/... is; the inference lane serves them too
    GET /v1/models, /v1/models/{model}
        what the caller's tenant may use, in OpenAI's list shape with vLLM's card fields

Errors on these paths are in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}` (broker.api.app.openai_shaped; the proxy's own refusals are shaped where they are
made).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from broker.api.access import principal
from broker.api.openapi import JSON, Operation, Param, Reply
from broker.model.jobs import NOT_BLANK
from broker.state.models import ModelCatalog
from routing.gateway.openai import error_body, unknown_model

__all__ = ["openai_operations"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_STARTED = int(time.time())  # a model's `created`: cpn does not know when it was made


def _models(catalog: ModelCatalog) -> Handler:
    async def list_models(request: web.Request) -> web.Response:
        tenant = principal(request).tenant
        cards = catalog.cards(tenant)
        return web.json_response(
            {"object": "list", "data": [card.json(_STARTED) for card in cards]}
        )

    return list_models


def _model(catalog: ModelCatalog) -> Handler:
    async def get_model(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        found = catalog.card(name, principal(request).tenant)
        if found is None:
            return web.Response(
                body=error_body(404, "model_not_found", unknown_model(name), "model"),
                status=404,
                content_type="application/json",
            )
        return web.json_response(found.json(_STARTED))

    return get_model


# what the gateway reads of the body (routing.gateway.openai.read_request); the rest goes to
# the model server as sent
_BODY = {
    "type": "object",
    "description": "OpenAI's request body; `model` chooses what serves it; the other fields "
    "go to the model server as sent",
    "required": ["model"],
    "properties": {
        "model": {
            "type": "string",
            "pattern": NOT_BLANK,
            "description": "a model, service, adapter or alias name (not blank)",
        },
        "stream": {"type": ["boolean", "null"], "description": "server-sent events"},
        "stream_options": {
            "type": ["object", "null"],
            "description": "with `stream: true`, the gateway sets include_usage (it meters tokens)",
        },
        "priority": {
            "type": ["integer", "null"],
            "description": "vLLM's request priority; the gateway sets it from X-Cpn-Priority or "
            "the tenant's",
        },
    },
}
_ANSWER = Reply(
    "the model server's answer, streamed through (server-sent events with `stream: true`)",
    headers={
        "X-Cpn-Site": "the site that answered",
        "X-Cpn-Service": "the service that served it (an alias's or a model's target)",
        "X-Cpn-Attempts": "sites tried, this one included",
        "X-Cpn-Route-Ms": "time spent choosing the site, ms",
    },
)
_HEADERS = (
    Param("X-Cpn-Client-Region", "header", "the client region; else the peer address's CIDR"),
    Param(
        "X-Cpn-Priority",
        "header",
        "the request's priority: higher first, negative sheddable (default: its tenant's)",
        {"type": "integer"},
    ),
    Param("X-Cpn-Session", "header", "keeps a session on one site"),
)


def openai_operations(proxy: Handler, catalog: ModelCatalog) -> list[Operation]:
    """The routes; `proxy` serves the POSTs (the gateway's proxy handler)."""
    posts = [
        ("/v1/chat/completions", "Create a chat completion (OpenAI)", "openai_chat"),
        ("/v1/completions", "Create a completion (OpenAI)", "openai_completions"),
        ("/v1/embeddings", "Create embeddings (OpenAI)", "openai_embeddings"),
    ]
    operations = [
        Operation(
            "POST",
            path,
            proxy,
            summary,
            name,
            params=_HEADERS,
            body=_BODY,
            body_types=(JSON,),
            replies={"default": _ANSWER},
            errors=(400, 401, 403, 404, 413, 429, 502, 503, 504),
            error_schema="OpenAIError",
        )  # fmt: skip
        for path, summary, name in posts
    ]
    operations.append(
        Operation(
            "GET",
            "/v1/models",
            _models(catalog),
            "List the models the caller may use (OpenAI)",
            "openai_models",
            replies={200: Reply("OpenAI's model list, with vLLM's card fields")},
            errors=(401, 403),
            error_schema="OpenAIError",
        )  # fmt: skip
    )
    operations.append(
        Operation(
            "GET",
            "/v1/models/{model}",
            _model(catalog),
            "Describe one model (OpenAI)",
            "openai_model",
            params=(Param("model", "path", "a model, service, adapter or alias name"),),
            replies={200: Reply("OpenAI's model object, with vLLM's card fields")},
            errors=(401, 403, 404),
            error_schema="OpenAIError",
        )  # fmt: skip
    )
    return operations
