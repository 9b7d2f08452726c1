"""The models a tenant may ask for by name on the OpenAI surface, and what serves each.

A client sends `model` in the body (docs/openai.md). It names, looked up in this order:

1. a service: a managed one (broker.model.services; its tenant's only) or one a site declares
   (everyone's);
2. a served model: the model name a service's endpoints declare (qwen2.5-72b-instruct); every
   service serving it that the tenant may use, at equal weight;
3. a LoRA adapter an endpoint serves (its `adapters`, read from the model server): the
   services whose endpoints load it;
4. an alias (broker.yaml `inference.aliases`): ranked targets, each a service or a model as
   above, weighted within a rank.

`resolve` gives routing.gateway.proxy's Targets: ranks of (service, weight). `cards` lists
what a tenant may use in OpenAI's model-list shape with vLLM's card fields (`root`, `parent`,
`max_model_len` where the model server said).

The catalog is derived from the router's snapshot of the registry (the endpoints) and the
live jobs (a managed service's endpoint names its replica job, whose tenant owns it), and is
rebuilt when the snapshot changed, at most every REBUILD_S: never per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from broker.placement.settings import Alias
from sites.model.snapshot import Snapshot

__all__ = ["REBUILD_S", "ModelCard", "ModelCatalog"]

REBUILD_S = 0.25
_RESOLVED_MAX = 10_000  # answers kept between rebuilds (models x tenants asking)
Targets = tuple[tuple[tuple[str, float], ...], ...]


@dataclass(frozen=True)
class ModelCard:
    """One entry of GET /v1/models."""

    id: str
    kind: str  # "service", "model", "adapter" or "alias"
    owner: str | None  # the tenant that owns it; None: every tenant may use it
    root: str  # the served model it runs (an alias: its first target's)
    parent: str | None = None  # an adapter's base model
    max_model_len: int | None = None
    services: tuple[str, ...] = ()  # what serves it (an alias: every target's services)

    def json(self, created: int) -> dict[str, object]:
        """OpenAI's model object, with vLLM's card fields."""
        return {
            "id": self.id,
            "object": "model",
            "created": created,
            "owned_by": self.owner or "cpn",
            "root": self.root,
            "parent": self.parent,
            "max_model_len": self.max_model_len,
            "permission": [],
            "cpn": {"kind": self.kind, "services": list(self.services)},
        }


@dataclass
class _Catalog:
    owner: dict[str, str | None] = field(default_factory=dict)  # service -> its tenant
    model_of: dict[str, str] = field(default_factory=dict)  # service -> its served model
    by_model: dict[str, list[str]] = field(default_factory=dict)  # model -> services
    by_adapter: dict[str, list[str]] = field(default_factory=dict)  # adapter -> services
    parent: dict[str, str] = field(default_factory=dict)  # adapter -> base model
    max_len: dict[str, int] = field(default_factory=dict)  # model or adapter -> max_model_len


class ModelCatalog:
    def __init__(
        self,
        *,
        snapshot: Callable[[], Snapshot],
        job_tenant: Callable[[str], str | None],
        aliases: Mapping[str, Alias],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`snapshot`: the registry's current sites and endpoints (the router's); `job_tenant`:
        a live job's tenant (None when it is not live)."""
        self._snapshot = snapshot
        self._job_tenant = job_tenant
        self.aliases = dict(aliases)
        self._clock = clock
        self._built: _Catalog = _Catalog()
        self._from: tuple[int, int] = (-1, -1)  # (id of the snapshot, its version)
        self._at = -REBUILD_S
        # (model, tenant) -> resolve's answer, for the catalog as built last
        self._resolved: dict[tuple[str, str | None], Targets | None] = {}

    def _catalog(self) -> _Catalog:
        snapshot = self._snapshot()
        now = self._clock()
        source = (id(snapshot), snapshot.version)
        if source != self._from and (self._from[0] != id(snapshot) or now - self._at >= REBUILD_S):
            self._built = self._build(snapshot)
            self._from, self._at = source, now
            self._resolved = {}
        return self._built

    def _build(self, snapshot: Snapshot) -> _Catalog:
        built = _Catalog()
        for (service, _site), ep in snapshot.services.items():
            owner = self._job_tenant(ep.job) if ep.job else None
            if service not in built.owner or owner is not None:
                built.owner[service] = owner
            built.model_of.setdefault(service, ep.model)
            _add(built.by_model, ep.model, service)
            length = getattr(ep, "max_model_len", None)
            if isinstance(length, int):
                built.max_len[ep.model] = length
            for adapter in getattr(ep, "adapters", ()) or ():
                _add(built.by_adapter, adapter, service)
                built.parent.setdefault(adapter, ep.model)
        return built

    @staticmethod
    def _may(catalog: _Catalog, service: str, tenant: str | None) -> bool:
        owner = catalog.owner.get(service)
        return owner is None or tenant is None or owner == tenant

    def _services(self, catalog: _Catalog, name: str, tenant: str | None) -> list[str]:
        """What serves a service, model or adapter name for `tenant` (an alias not included)."""
        if name in catalog.owner:
            return [name] if self._may(catalog, name, tenant) else []
        for table in (catalog.by_model, catalog.by_adapter):
            found = table.get(name)
            if found:
                return [s for s in found if self._may(catalog, s, tenant)]
        return []

    def resolve(self, model: str, tenant: str | None) -> Targets | None:
        """`model`'s targets for `tenant` (None: every tenant's, as an operator or with auth
        off); None when the name is nothing the tenant may use."""
        catalog = self._catalog()
        key = (model, tenant)
        resolved = self._resolved
        if key in resolved:
            return resolved[key]
        if len(resolved) >= _RESOLVED_MAX:
            resolved.clear()
        found = resolved[key] = self._resolve(catalog, model, tenant)
        return found

    def _resolve(self, catalog: _Catalog, model: str, tenant: str | None) -> Targets | None:
        direct = self._services(catalog, model, tenant)
        if direct:
            weight = 1.0 / len(direct)
            return (tuple((service, weight) for service in direct),)
        alias = self.aliases.get(model)
        if alias is None:
            return None
        ranks = []
        for rank in alias.ranks:
            out: list[tuple[str, float]] = []
            for target in rank:
                services = self._services(catalog, target.target, tenant)
                for service in services:
                    out.append((service, target.weight / len(services)))
            if out:
                ranks.append(tuple(out))
        return tuple(ranks) or None

    def served_name(self, service: str, requested: str) -> str | None:
        """The name `service`'s model server serves a request by, when `requested` (an alias, a
        service's name) is not one it knows; None: `requested` is its model or an adapter."""
        catalog = self._catalog()
        model = catalog.model_of.get(service)
        if model is None or requested == model or requested in catalog.by_adapter:
            return None
        return model

    def cards(self, tenant: str | None) -> list[ModelCard]:
        """What `tenant` may use, by id: services, served models, adapters and aliases."""
        catalog = self._catalog()
        cards: dict[str, ModelCard] = {}
        for model, services in catalog.by_model.items():
            mine = [s for s in services if self._may(catalog, s, tenant)]
            if mine:
                owners = {catalog.owner.get(s) for s in mine}
                owner = owners.pop() if len(owners) == 1 else None
                cards[model] = ModelCard(
                    model, "model", owner, model, None, catalog.max_len.get(model), tuple(mine)
                )
        for service, model in catalog.model_of.items():
            if service not in cards and self._may(catalog, service, tenant):
                cards[service] = ModelCard(
                    service, "service", catalog.owner.get(service), model, None,
                    catalog.max_len.get(model), (service,),
                )  # fmt: skip
        for adapter, services in catalog.by_adapter.items():
            mine = [s for s in services if self._may(catalog, s, tenant)]
            if mine and adapter not in cards:
                base = catalog.parent[adapter]
                cards[adapter] = ModelCard(
                    adapter, "adapter", None, adapter, base, catalog.max_len.get(base),
                    tuple(mine),
                )  # fmt: skip
        for name in self.aliases:
            targets = self.resolve(name, tenant)
            if targets and name not in cards:
                first = targets[0][0][0]
                serving = tuple(dict.fromkeys(s for rank in targets for s, _ in rank))
                cards[name] = ModelCard(
                    name, "alias", None, catalog.model_of.get(first, first), None,
                    catalog.max_len.get(catalog.model_of.get(first, "")), serving,
                )  # fmt: skip
        return [cards[key] for key in sorted(cards)]

    def card(self, model: str, tenant: str | None) -> ModelCard | None:
        for found in self.cards(tenant):
            if found.id == model:
                return found
        return None


def _add(table: dict[str, list[str]], key: str, service: str) -> None:
    services = table.setdefault(key, [])
    if service not in services:
        services.append(service)
