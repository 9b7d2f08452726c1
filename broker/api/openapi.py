"""The broker's route table and the OpenAPI 3.1 document built from it.

Every endpoint is one `Operation`: its aiohttp method and path, its handler, and what the
document says about it (parameters, body, replies). `register(app, op)` adds the route and
records the operation in `app[OPERATIONS]`, and `/openapi.json` is `document(app[OPERATIONS])`,
so a route cannot be served without its spec, and what the spec says of its query parameters
holds: each is one value (a repeated one is a 400 naming it). Body and reply schemas come from
the pydantic models (`models_json_schema`, every `$defs` entry lifted into
`components.schemas`); a body model is described in validation mode (what the broker
accepts), a reply model in serialization mode (what it sends).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from broker.model.errors import InvalidRequest

__all__ = [
    "ANY_METHODS",
    "CONTINUE",
    "ERROR_SCHEMA",
    "JSON",
    "OPERATIONS",
    "YAML",
    "Many",
    "Operation",
    "Param",
    "Reply",
    "document",
    "register",
    "single_query_values",
    "spec_path",
]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
JSON = "application/json"
YAML = ("application/yaml", "text/yaml")
# what a "*" route (the inference proxy) is documented with: every method OpenAPI names but TRACE
ANY_METHODS = ("get", "put", "post", "delete", "options", "head", "patch")
REF = "#/components/schemas/{model}"
_VARIABLE = re.compile(r"\{([A-Za-z_]\w*):[^/]*\}")  # a variable with its regex
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "every 4xx and 5xx the broker itself answers",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "machine-readable, e.g. invalid"},
                "message": {"type": "string", "description": "for a person"},
                "field": {
                    "type": ["string", "null"],
                    "description": "the body field, parameter or header at fault, if one is",
                },
            },
            "required": ["code", "message", "field"],
            "additionalProperties": False,
        }
    },
    "required": ["error"],
    "additionalProperties": False,
}
OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "an error on the OpenAI surface (docs/openai.md), in OpenAI's shape",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string", "description": "for a person"},
                "type": {"type": "string", "description": "e.g. invalid_request_error"},
                "param": {
                    "type": ["string", "null"],
                    "description": "the body field, parameter or header at fault, if one is",
                },
                "code": {
                    "type": ["string", "null"],
                    "description": "machine-readable, e.g. model_not_found",
                },
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
ERROR_REASONS = {
    400: "invalid or malformed request (field names what)",
    404: "no such resource",
    409: "conflict: illegal transition, duplicate, or a lost race",
    410: "gone: the continue token has expired; list again from the first page",
    413: "request body too large",
    415: "unsupported body content type",
    429: "rate limited (Retry-After says when to retry)",
    502: "the site behind could not be reached or failed",
    503: "unavailable: the registry, the site, or every site's capacity",
    504: "the site behind did not answer in time",
}


@dataclass(frozen=True)
class Many:
    """A JSON array of a model (a reply listing records)."""

    model: type[BaseModel]


Schema = type[BaseModel] | Many | Mapping[str, Any]


@dataclass(frozen=True)
class Param:
    """A path, query, header or cookie parameter."""

    name: str
    where: Literal["path", "query", "header", "cookie"]
    description: str
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})
    required: bool = False


@dataclass(frozen=True)
class Reply:
    """One documented reply: its schema (None: no fixed schema) and content type."""

    description: str
    schema: Schema | None = None
    content_type: str = JSON
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Operation:
    """One route: served by `handler`, described by the rest.

    `body` is the request body's schema (None: no body); `body_types` its content types;
    `body_required` False for a pass-through body (the inference proxy). `errors` are the
    error statuses the handler answers with the JSON error body.
    """

    method: str
    path: str
    handler: Handler
    summary: str
    operation_id: str
    params: tuple[Param, ...] = ()
    body: Schema | None = None
    body_types: tuple[str, ...] = (JSON, *YAML)
    body_required: bool = True
    replies: Mapping[int | str, Reply] = field(default_factory=dict)  # status or "default"
    errors: tuple[int, ...] = ()
    error_schema: str = "Error"  # "OpenAIError": the OpenAI surface's shape

    @property
    def methods(self) -> tuple[str, ...]:
        """The lower-case methods the document lists for this route."""
        return ANY_METHODS if self.method == "*" else (self.method.lower(),)


OPERATIONS = web.AppKey("operations", list[Operation])
# a list's page token: what it holds JSON Schema cannot say, so the description does
CONTINUE = Param(
    "continue",
    "query",
    "the previous page's `continue`: the next page; empty: the first page; a value this API "
    "did not give is a 400 (not expressible in JSON Schema)",
)


def register(app: web.Application, op: Operation) -> None:
    """Serve `op` on `app` and list it in the app's OpenAPI document."""
    app.router.add_route(op.method, op.path, single_query_values(op))
    app.setdefault(OPERATIONS, []).append(op)


def single_query_values(op: Operation) -> Handler:
    """`op`'s handler, refusing a query parameter given twice: the document says one value
    (no parameter is an array), and which of two a handler read would be an accident."""
    names = tuple(p.name for p in op.params if p.where == "query")
    handler = op.handler
    if not names:
        return handler

    async def checked(request: web.Request) -> web.StreamResponse:
        query = request.query
        if len(query) > 1:
            for name in names:
                if len(query.getall(name, ())) > 1:
                    raise InvalidRequest(f"{name} is given more than once", field=name)
        return await handler(request)

    return checked


def spec_path(path: str) -> str:
    """aiohttp's `/v1/infer/{service}/{path:.*}` -> OpenAPI's `/v1/infer/{service}/{path}`."""
    return _VARIABLE.sub(r"{\1}", path)


def _models(schema: Schema | None) -> Iterable[type[BaseModel]]:
    if isinstance(schema, Many):
        yield schema.model
    elif isinstance(schema, type):
        yield schema


def document(operations: Iterable[Operation], *, title: str, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `operations`."""
    ops = list(operations)
    wanted: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {}
    for op in ops:
        for model in _models(op.body):
            wanted[(model, "validation")] = None
        for reply in op.replies.values():
            for model in _models(reply.schema):
                wanted[(model, "serialization")] = None
    refs, defs = models_json_schema(list(wanted), ref_template=REF)
    # a model that reads differently than it writes gets "-Input" and "-Output" schemas; the
    # input is the one tenants write against, so it keeps the model's own name
    renames = {
        REF.format(model=name): REF.format(model=name.removesuffix("-Input"))
        for name in defs.get("$defs", {})
        if name.endswith("-Input")
    }
    refs = {key: _renamed(value, renames) for key, value in refs.items()}
    schemas: dict[str, Any] = {"Error": ERROR_SCHEMA, "OpenAIError": OPENAI_ERROR_SCHEMA}
    for name, schema in defs.get("$defs", {}).items():
        schemas[name.removesuffix("-Input")] = _keys_named(_renamed(schema, renames))

    def resolve(schema: Schema | None, mode: JsonSchemaMode) -> dict[str, Any]:
        if schema is None:
            return {}
        if isinstance(schema, Many):
            return {"type": "array", "items": refs[(schema.model, mode)]}
        if isinstance(schema, type):
            return dict(refs[(schema, mode)])
        return dict(schema)

    paths: dict[str, dict[str, Any]] = {}
    for op in ops:
        item: dict[str, Any] = {
            "summary": op.summary,
            "operationId": op.operation_id,
            "responses": _responses(op, resolve),
        }
        if op.params:
            item["parameters"] = [_param(p) for p in op.params]
        if op.body is not None:
            body = resolve(op.body, "validation")
            item["requestBody"] = {
                "required": op.body_required,
                "content": {ctype: {"schema": body} for ctype in op.body_types},
            }
        entry = paths.setdefault(spec_path(op.path), {})
        for method in op.methods:
            if method in entry:
                raise ValueError(f"{method.upper()} {op.path} is registered twice")
            one = dict(item)
            if len(op.methods) > 1:
                one["operationId"] = f"{op.operation_id}_{method}"
            entry[method] = one
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def _keys_named(schema: Any) -> Any:
    """`schema` with a mapping's key pattern as its `propertyNames` too: pydantic writes a
    `dict[Name, X]` as `patternProperties`, which says nothing of a key that does not match,
    while the broker refuses it (a 400 naming the key)."""
    if isinstance(schema, list):
        return [_keys_named(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _keys_named(value) for key, value in schema.items()}
    patterns = out.get("patternProperties")
    if isinstance(patterns, dict) and len(patterns) == 1 and "propertyNames" not in out:
        out["propertyNames"] = {"pattern": next(iter(patterns))}
    return out


def _renamed(schema: Any, renames: Mapping[str, str]) -> Any:
    """`schema` with every `$ref` in `renames` replaced."""
    if isinstance(schema, dict):
        return {
            key: renames.get(value, value) if key == "$ref" else _renamed(value, renames)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_renamed(item, renames) for item in schema]
    return schema


def _param(param: Param) -> dict[str, Any]:
    return {
        "name": param.name,
        "in": param.where,
        "description": param.description,
        "required": param.required or param.where == "path",
        "schema": dict(param.schema),
    }


def _responses(
    op: Operation, resolve: Callable[[Schema | None, JsonSchemaMode], dict[str, Any]]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status, reply in op.replies.items():
        entry: dict[str, Any] = {"description": reply.description}
        if reply.schema is not None:
            entry["content"] = {
                reply.content_type: {"schema": resolve(reply.schema, "serialization")}
            }
        if reply.headers:
            entry["headers"] = {
                name: {"description": text, "schema": {"type": "string"}}
                for name, text in reply.headers.items()
            }
        out[str(status)] = entry
    error = {"$ref": f"#/components/schemas/{op.error_schema}"}
    for status in op.errors:
        out[str(status)] = {
            "description": ERROR_REASONS.get(status, "error"),
            "content": {JSON: {"schema": error}},
        }
    return out
