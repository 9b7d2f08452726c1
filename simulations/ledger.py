"""What a simulation's runs cost, use and emit: results `cost`, `energy`, `carbon` and each
site's utilization.

A run is charged for what it ran: from its start to its end, or to the horizon, or to when its
site was lost or it was preempted. Cost is the placement's compute cost pro rata of that time
(at list prices: the energy and carbon a green policy prices in steer placement, not the bill)
plus its egress; energy is the allocated devices' and cores' TDP (configs/devices.yaml) x time
x the site's PUE; carbon is that energy x the site's grid factor.
"""

from __future__ import annotations

from collections.abc import Sequence

from simulations.jobs import JobClass, JobRun
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec

__all__ = ["Ledger"]


class Ledger:
    """Per site (in the engine's order) and per tenant (the arrivals' codes): cost (USD),
    energy (kWh), carbon (kg CO2e, per tenant) and device- and core-seconds busy (per site)."""

    def __init__(self, specs: Sequence[SiteSpec], tenants: int, catalog: DeviceCatalog) -> None:
        self.power_w = {m: (catalog.get(m).power_w or 0.0) for m in catalog.models}
        self.core_w = catalog.cpu.power_w or 0.0
        self.pue = [spec.power.pue for spec in specs]
        self.grid = [spec.power.grid_kgco2_per_kwh for spec in specs]
        self.busy_gpu_s = [0.0] * len(specs)
        self.busy_core_s = [0.0] * len(specs)
        self.cost_site = [0.0] * len(specs)
        self.kwh_site = [0.0] * len(specs)
        self.cost_tenant = [0.0] * tenants
        self.kwh_tenant = [0.0] * tenants
        self.kgco2_tenant = [0.0] * tenants

    def watts(self, gpus: int, model: str | None, cpu: float) -> float:
        """What a run's devices and cores draw at TDP, before the site's PUE."""
        return gpus * self.power_w.get(model or "", 0.0) + cpu * self.core_w

    def charge(self, run: JobRun, tenant: int, cls: JobClass | None, until: float) -> None:
        """`run` of a job of `tenant` (and class `cls`) costs, uses and emits up to `until`."""
        ran = max(0.0, until - run.start)
        s = run.site
        cost = run.compute_rate * ran + run.egress_usd
        kwh = run.watts * ran / 3.6e6 * self.pue[s]
        self.cost_site[s] += cost
        self.cost_tenant[tenant] += cost
        self.kwh_site[s] += kwh
        self.kwh_tenant[tenant] += kwh
        self.kgco2_tenant[tenant] += kwh * self.grid[s]
        if cls is not None:
            self.busy_gpu_s[s] += cls.gpus * ran
            self.busy_core_s[s] += cls.cpu * ran
