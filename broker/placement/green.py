"""The green objective (东数西算: east data, west computing): energy and carbon priced into a
site's rates, for the fast path, the batch pass, `cpn plan` and the simulator alike.

Off by default. With `scheduling.energy_priced` every device-hour at a site also costs its
energy, power_w (configs/devices.yaml) x the site's PUE x its usd_per_kwh; every core-hour the
reference CPU's per-core power the same way. With `scheduling.carbon_usd_per_tonne` > 0 it also
costs that energy's carbon, x the site's grid_kgco2_per_kwh, at the operator's carbon price.
Both are folded into the offer's prices (broker.placement.pricing.green_rate), so placement ranks
sites by the total without changing its arithmetic; `Green` keeps the list prices and the per-hour
parts, for the decision's breakdown and for the batch pass's plan problem (which folds them
again with the same function, so both price every option to the same float).

A site in the west with cheap hydro power and a clean grid then wins work that an eastern
site's list price alone would have won (docs/placement.md, the fair-share scenario's sibling
configs/scenarios/green.yaml).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from broker.placement import pricing
from broker.placement.site import Green
from sites.model.catalog import DeviceCatalog
from sites.model.spec import Prices, SiteSpec

if TYPE_CHECKING:  # broker.placement.settings imports routing; scripts under bench/ shadow it
    from broker.placement.settings import SchedulingSettings

__all__ = ["Green", "green_of", "priced"]


def green_of(spec: SiteSpec, catalog: DeviceCatalog, settings: SchedulingSettings) -> Green | None:
    """The site's energy and carbon per device- and core-hour; None when neither is priced."""
    tonne = settings.carbon_usd_per_tonne
    if not settings.energy_priced and tonne <= 0:
        return None
    power = spec.power
    energy_on = settings.energy_priced
    gpu_energy: dict[str, float] = {}
    gpu_co2: dict[str, float] = {}
    for model in spec.prices.usd_per_gpu_hour:
        watts = float(catalog.get(model).power_w or 0.0) if model in catalog else 0.0
        gpu_energy[model] = (
            pricing.energy_usd_per_hour(watts, power.pue, power.usd_per_kwh) if energy_on else 0.0
        )
        gpu_co2[model] = pricing.carbon_kg_per_hour(watts, power.pue, power.grid_kgco2_per_kwh)
    core = catalog.get(catalog.cpu_reference)
    core_watts = float(core.power_w or 0.0)
    return Green(
        list_prices=spec.prices,
        gpu_energy_usd_h=gpu_energy,
        gpu_co2_kg_h=gpu_co2,
        core_energy_usd_h=pricing.energy_usd_per_hour(core_watts, power.pue, power.usd_per_kwh)
        if energy_on
        else 0.0,
        core_co2_kg_h=pricing.carbon_kg_per_hour(core_watts, power.pue, power.grid_kgco2_per_kwh),
        usd_per_tonne=tonne,
    )


def priced(green: Green) -> Prices:
    """The list prices with energy and carbon folded into every device- and core-hour."""
    p = green.list_prices
    t = green.usd_per_tonne
    gpu: Mapping[str, float] = {
        m: pricing.green_rate(
            rate, green.gpu_energy_usd_h.get(m, 0.0), green.gpu_co2_kg_h.get(m, 0.0), t
        )
        for m, rate in p.usd_per_gpu_hour.items()
    }
    return p.model_copy(
        update={
            "usd_per_gpu_hour": dict(gpu),
            "usd_per_core_hour": pricing.green_rate(
                p.usd_per_core_hour, green.core_energy_usd_h, green.core_co2_kg_h, t
            ),
        }
    )
