"""Request bodies: content type, parsing, and strict validation against the declared model.

A body is JSON (`application/json`, or no Content-Type at all) or YAML (`application/yaml`,
`text/yaml`); any other declared type is refused with 415 `unsupported_media`. Validation is
pydantic's strict mode, so what the OpenAPI document says is what is accepted: `false` is not
an integer, `"4"` is not a number, `4.0` is not an integer. Strict JSON still reads what JSON
has no type for: an ISO 8601 string as a datetime, an array as a tuple, a string as an enum
value. A YAML body is parsed with `yaml.safe_load`, turned into plain JSON values (a YAML
timestamp becomes its ISO 8601 string) and then validated exactly like a JSON body.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import yaml
from aiohttp import web
from pydantic import BaseModel

from broker.api.openapi import JSON, YAML
from broker.model.errors import InvalidRequest
from sites.model.config import field_path

__all__ = ["UNSUPPORTED_MEDIA", "read_model"]

M = TypeVar("M", bound=BaseModel)
UNSUPPORTED_MEDIA = "unsupported_media"


async def read_model(request: web.Request, model: type[M]) -> M:
    """The request's body as a `model`, strictly validated (pydantic ValidationError if not)."""
    declared = "Content-Type" in request.headers
    content_type = request.content_type if declared else JSON
    if content_type != JSON and content_type not in YAML:
        raise InvalidRequest(
            f"unsupported content type {content_type!r}: send {JSON} or {' or '.join(YAML)}",
            field="Content-Type",
            code=UNSUPPORTED_MEDIA,
        )
    raw = await request.read()
    if content_type in YAML:
        raw = _yaml_as_json(raw)
    return model.model_validate_json(raw, strict=True)


def _yaml_as_json(raw: bytes) -> bytes:
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise InvalidRequest(f"body is not YAML: {exc}", code="malformed") from None
    return json.dumps(_plain(data, ()), allow_nan=False).encode()


def _plain(value: Any, loc: tuple[int | str, ...]) -> Any:
    """YAML's values as JSON's; what JSON cannot say is an error naming where it is."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"{value} is not a finite number", field=field_path(loc) or None)
        return value
    if isinstance(value, dt.date):  # datetime too: YAML timestamps
        return value.isoformat()
    if isinstance(value, list):
        return [_plain(item, (*loc, i)) for i, item in enumerate(value)]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidRequest(
                    f"mapping key {key!r} is not a string", field=field_path(loc) or None
                )
            out[key] = _plain(item, (*loc, key))
        return out
    raise InvalidRequest(
        f"a YAML {type(value).__name__} has no JSON equivalent", field=field_path(loc) or None
    )


# -- pages (GET /v1/jobs, /v1/sites, /v1/audit) -------------------------------------------------


def query_limit(query: Mapping[str, str], *, default: int, maximum: int) -> int:
    """A list's `limit` parameter: 1 to `maximum`, else a 400 naming it."""
    text = query.get("limit", str(default))
    if not text.isdigit() or not 1 <= int(text) <= maximum:
        raise InvalidRequest(f"limit must be 1 to {maximum}, got {text!r}", field="limit")
    return int(text)


def page_response(items: list[bytes], next_token: str | None) -> web.Response:
    """`{"items": [...], "continue": ...}` from items already encoded as JSON (a page of
    records goes out as etcd holds them, not decoded and encoded again)."""
    body = b'{"items":[' + b",".join(items) + b'],"continue":' + json.dumps(next_token).encode()
    return web.Response(body=body + b"}", content_type="application/json")
