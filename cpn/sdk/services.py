"""Managed inference services through /v1/services (docs/services.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import yaml as pyyaml
from pydantic import BaseModel

from broker.model.services import ServiceSpec
from cpn.sdk.errors import Invalid
from cpn.sdk.jobs import spec_body
from cpn.sdk.models import Service, ServicePage, ServiceSummary
from cpn.sdk.transport import Transport, parse, segment

__all__ = ["AsyncServices"]

PAGE_SIZE = 500


def _name_of(spec: ServiceSpec | Mapping[str, Any] | str) -> str:
    """The service's name, which its path repeats (PUT /v1/services/{name})."""
    if isinstance(spec, str):
        try:
            doc = pyyaml.safe_load(spec)
        except pyyaml.YAMLError as exc:
            raise Invalid(0, f"the service's YAML cannot be read: {exc}", "spec") from None
    elif isinstance(spec, BaseModel):
        doc = {"name": getattr(spec, "name", None)}
    else:
        doc = spec
    name = doc.get("name") if isinstance(doc, Mapping) else None
    if not isinstance(name, str) or not name:
        raise Invalid(0, "a service spec needs a name", "name")
    return name


class AsyncServices:
    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def apply(self, spec: ServiceSpec | Mapping[str, Any] | str) -> Service:
        """Create or update a service from its spec (a model, a mapping or its file's YAML
        text); its replicas follow."""
        name = _name_of(spec)
        path = f"/v1/services/{segment(name, 'name')}"
        body = await self._t.request("PUT", path, **spec_body(spec, "spec"))
        return parse(Service, body)

    async def get(self, name: str) -> Service:
        body = await self._t.request("GET", f"/v1/services/{segment(name, 'name')}")
        return parse(Service, body)

    async def list(self, *, tenant: str | None = None) -> AsyncIterator[ServiceSummary]:
        """Services by name, fetched a page at a time as the iteration goes."""
        params = {"limit": str(PAGE_SIZE)}
        if tenant:
            params["tenant"] = tenant
        while True:
            page = parse(ServicePage, await self._t.request("GET", "/v1/services", params=params))
            for item in page.items:
                yield item
            if not page.continue_:
                return
            params["continue"] = page.continue_

    async def delete(self, name: str) -> Service:
        """Delete a service: its replicas drain and stop, then it is gone."""
        body = await self._t.request("DELETE", f"/v1/services/{segment(name, 'name')}")
        return parse(Service, body)
