"""The federation's tenancy in etcd, mirrored by every replica (`TenancyBook`).

Layout (sites.model.keys): /cpn/v1/tenancy/config holds cohorts, priority classes, fair_share and
preemption (a TenancyFile without tenants); /cpn/v1/tenancy/tenants/<name> one TenantPolicy
each; /cpn/v1/tenancy/fair-share the leader's decayed usage per tenant (`FairShareRecord`).

configs/tenants.yaml seeds an empty registry (`seed`, when the broker starts and no config key
exists yet); from then on the registry is the truth, changed by `put_tenant`, `delete_tenant`
and `apply` (the API and `cpn tenant set` / `cpn tenants apply`), each one guarded
transaction that carries the call's audit entry. Every replica rebuilds its `Quotas` when a
key changes (rare: an operator's edit); a value that does not validate is skipped and logged,
never applied.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.model.audit_intent import audit_puts, committed
from broker.model.errors import Conflict, InvalidRequest
from broker.model.tenants import TenancyFile, TenantPolicy
from broker.placement.tenancy import SHARE_DIMENSIONS, FairShare, Quotas
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.registry.client import Guard, Registry
from sites.registry.mirror import KeyValues, PrefixMirror

__all__ = ["FairShareRecord", "TenancyBook", "gpu_quotas"]

log = logging.getLogger(__name__)


class FairShareRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    at: float
    half_life_s: float = Field(gt=0)
    levels: dict[str, dict[str, float]] = Field(default_factory=dict)


class TenancyBook:
    """What the registry says about tenants, kept current by a mirror of /cpn/v1/tenancy/."""

    def __init__(self, *, registry: Registry, catalog: DeviceCatalog) -> None:
        self.registry = registry
        self.catalog = catalog
        self._config = TenancyFile()
        self._config_rev = 0
        self._tenants: dict[str, TenantPolicy] = {}
        self._revisions: dict[str, int] = {}
        self.fair: FairShare | None = None
        self.file = TenancyFile()
        self.quotas = Quotas(self.file, catalog)
        self.mirror = PrefixMirror(
            registry=registry,
            prefix=keys.TENANCY,
            on_reset=self._reset,
            on_event=self._event,
            keep_items=False,
        )

    # -- the mirror ---------------------------------------------------------------------------

    def _reset(self, kvs: KeyValues) -> None:
        self._config, self._config_rev = TenancyFile(), 0
        self._tenants.clear()
        self._revisions.clear()
        self.fair = None
        for key, value, rev in kvs:
            self._apply(key, value, rev)
        self._rebuild()

    def _event(self, key: str, value: bytes | None, rev: int) -> None:
        if self._apply(key, value, rev):
            self._rebuild()

    def _apply(self, key: str, value: bytes | None, rev: int) -> bool:
        """True when quotas must be rebuilt."""
        try:
            if key == keys.TENANCY_CONFIG:
                self._config = TenancyFile() if value is None else _config(value)
                self._config_rev = 0 if value is None else rev
                return True
            if key.startswith(keys.TENANCY_TENANTS):
                name = key[len(keys.TENANCY_TENANTS) :]
                if value is None:
                    self._tenants.pop(name, None)
                    self._revisions.pop(name, None)
                else:
                    self._tenants[name] = TenantPolicy.model_validate_json(value)
                    self._revisions[name] = rev
                return True
            if key == keys.FAIR_SHARE:
                if value is None:
                    self.fair = None
                else:
                    got = FairShareRecord.model_validate_json(value)
                    self.fair = FairShare(got.half_life_s, got.at, got.levels)
        except (ValidationError, ValueError) as exc:
            log.error("tenancy: %s does not validate, skipped: %s", key, exc)
        return False

    def _rebuild(self) -> None:
        try:
            file = TenancyFile.model_validate(
                {**self._config.model_dump(exclude={"tenants"}), "tenants": self._tenants}
            )
        except ValidationError as exc:
            # a tenant naming a cohort removed meanwhile: keep the last good tree, loudly
            log.error("tenancy: the registry's tenants and cohorts disagree, kept as was: %s", exc)
            return
        self.file = file
        self.quotas = Quotas(file, self.catalog)

    # -- writes -------------------------------------------------------------------------------

    async def seed(self, file: TenancyFile) -> bool:
        """Write configs/tenants.yaml's content if the registry has no tenancy yet; True if so."""
        puts = {keys.TENANCY_CONFIG: _config_bytes(file)}
        for name, policy in file.tenants.items():
            puts[keys.tenant_policy(name)] = policy.model_dump_json().encode()
        return await self.registry.commit(
            guards=[Guard(keys.TENANCY_CONFIG, mod_revision=0)], puts=puts
        )

    def check(self, name: str, policy: TenantPolicy | None) -> TenancyFile:
        """The tenancy with `name` set to `policy` (None: removed); InvalidRequest (400) if it
        does not validate (a cohort that does not exist)."""
        try:
            return self.file.with_tenant(name, policy)
        except ValidationError as exc:
            where, message = _first_error(exc)
            raise InvalidRequest(message, field=where) from exc

    async def put_tenant(self, name: str, policy: TenantPolicy) -> bool:
        """Create or replace one tenant; True if it is new. Conflict (409): it changed meanwhile."""
        self.check(name, policy)
        rev = self._revisions.get(name, 0)
        ok = await self.registry.commit(
            guards=[
                Guard(keys.tenant_policy(name), mod_revision=rev),
                Guard(keys.TENANCY_CONFIG, mod_revision=self._config_rev),
            ],
            puts={
                keys.tenant_policy(name): policy.model_dump_json().encode(),
                **audit_puts(name, f"tenant/{name}"),
            },
        )
        if not ok:
            raise Conflict(f"tenant {name} or the cohorts changed meanwhile; retry")
        committed()
        return rev == 0

    async def delete_tenant(self, name: str) -> bool:
        """Remove one tenant (it is unlimited from then on); False if there was none."""
        rev = self._revisions.get(name, 0)
        if not rev:
            return False
        ok = await self.registry.commit(
            guards=[Guard(keys.tenant_policy(name), mod_revision=rev)],
            puts=audit_puts(name, f"tenant/{name}"),
            deletes=[keys.tenant_policy(name)],
        )
        if not ok:
            raise Conflict(f"tenant {name} changed meanwhile; retry")
        committed()
        return True

    async def apply(self, file: TenancyFile) -> None:
        """Replace the whole tenancy (cohorts, classes, every tenant) in one transaction."""
        guards = [Guard(keys.TENANCY_CONFIG, mod_revision=self._config_rev)]
        guards += [Guard(keys.tenant_policy(n), mod_revision=r) for n, r in self._revisions.items()]
        puts = {keys.TENANCY_CONFIG: _config_bytes(file), **audit_puts(None, "tenancy")}
        for name, policy in file.tenants.items():
            puts[keys.tenant_policy(name)] = policy.model_dump_json().encode()
        deletes = [keys.tenant_policy(n) for n in self._revisions if n not in file.tenants]
        ok = await self.registry.commit(guards=guards, puts=puts, deletes=deletes)
        if not ok:
            raise Conflict("the tenancy changed meanwhile; retry")
        committed()

    async def save_fair(self, fair: FairShare, guard: Guard) -> bool:
        """The leader's decayed usage (fenced on its leader key)."""
        if fair.at is None:
            return False
        record = FairShareRecord(
            at=fair.at,
            half_life_s=fair.half_life_s,
            levels={
                t: {d: round(v.get(d, 0.0), 6) for d in SHARE_DIMENSIONS}
                for t, v in fair.levels.items()
            },
        )
        return await self.registry.commit(
            guards=[guard], puts={keys.FAIR_SHARE: record.model_dump_json().encode()}
        )


def gpu_quotas(file: TenancyFile) -> Mapping[str, int]:
    """tenant -> nominal GPU quota, for the tenants that set one (the quota_high alert)."""
    return {n: p.quota.gpus for n, p in file.tenants.items() if p.quota.gpus is not None}


def _config(raw: bytes) -> TenancyFile:
    return TenancyFile.model_validate({**json.loads(raw), "tenants": {}})


def _config_bytes(file: TenancyFile) -> bytes:
    return file.model_dump_json(exclude={"tenants"}).encode()


def _first_error(exc: ValidationError) -> tuple[str | None, str]:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or None
    return where, str(err["msg"]).removeprefix("Value error, ")
