"""The price of running a job at a site with a device model, and its parts: one place.

Every consumer prices through here: the fast path (broker.placement.feasibility's scan, the
placement index: broker.placement.price_index), the batch pass (broker.plan.batch.decisions),
`cpn plan` (broker.plan.options.job_cost) and the simulator's baselines. The formula
(docs/placement.md):

    compute  = duration_hours * (cpu * usd_per_core_hour + mem_gb * usd_per_gb_mem_hour
                                 + gpus * usd_per_gpu_hour[model])
    egress   = size_gb * usd_per_gb        (0 inside the data's region)
    latency  = latency_weight * rtt_ms
    total    = compute + egress + latency

The association is fixed (the cores and memory first, then the devices; compute, then egress,
then latency), so every path that prices the same option gets the same float to the last bit,
and the batch optimizer's objective, the fast path's choice and `cpn plan evaluate` agree.

Energy and carbon (the green objective, off by default; broker.placement.green) are priced into the
rates themselves, so no consumer changes its arithmetic and every path still agrees:

    rate     = list rate + energy + carbon        (per device-hour, per core-hour: `green_rate`)
    energy   = watts / 1000 * pue * usd_per_kwh                       (`energy_usd_per_hour`)
    carbon   = watts / 1000 * pue * grid_kgco2_per_kwh * usd_per_tonne / 1000

`Breakdown.energy_usd` and `carbon_usd` say how much of `compute_usd` they are (of which, not
added again).

Pure: plain floats in, floats out. The functions take rates as numbers rather than a price
model, because the broker's site prices (sites.model.spec.Prices) and the plan format's
(broker.plan.problem.Price) name the same rates differently.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Breakdown",
    "breakdown",
    "compute_usd",
    "carbon_kg_per_hour",
    "egress_usd",
    "energy_usd_per_hour",
    "green_rate",
    "hourly_usd",
    "latency_usd",
    "total_usd",
]


@dataclass(frozen=True, slots=True)
class Breakdown:
    """An option's cost in its parts, USD each."""

    compute_usd: float  # devices, cores and memory for the run's duration
    egress_usd: float  # moving the job's data to the site
    latency_usd: float  # latency_weight (USD per ms) x the user's RTT to the site
    energy_usd: float = (
        0.0  # of compute_usd: the energy priced into the rates (broker.placement.green)
    )
    carbon_usd: float = 0.0  # of compute_usd: the carbon priced into the rates
    co2_kg: float = 0.0  # the run's estimated emissions, when carbon is priced

    @property
    def total_usd(self) -> float:
        """The option's cost: the parts added in pricing's one order."""
        return total_usd(self.compute_usd, self.egress_usd, self.latency_usd)


def hourly_usd(
    cpu: float,
    mem_gb: float,
    usd_per_core_hour: float,
    usd_per_gb_mem_hour: float,
    gpus: int = 0,
    usd_per_gpu_hour: float = 0.0,
) -> float:
    """USD per hour for `cpu` cores, `mem_gb` GB of memory and `gpus` devices of one model."""
    hourly = cpu * usd_per_core_hour + mem_gb * usd_per_gb_mem_hour
    if gpus:
        hourly += gpus * usd_per_gpu_hour
    return hourly


def compute_usd(duration_hours: float, hourly: float) -> float:
    """USD for holding an `hourly` rate for `duration_hours`."""
    return duration_hours * hourly


def egress_usd(size_gb: float, usd_per_gb: float) -> float:
    """USD to move `size_gb` GB at `usd_per_gb` (0 per GB inside the data's region)."""
    return size_gb * usd_per_gb


def latency_usd(latency_weight: float, rtt_ms: float) -> float:
    """The latency term: `latency_weight` USD per ms times the user's RTT in ms."""
    return latency_weight * rtt_ms


def total_usd(compute: float, egress: float, latency: float) -> float:
    """An option's total USD from its parts, always in this order."""
    return compute + egress + latency


def energy_usd_per_hour(watts: float, pue: float, usd_per_kwh: float) -> float:
    """USD per hour of electricity for a device drawing `watts`, facility overhead included."""
    return watts / 1000.0 * pue * usd_per_kwh


def carbon_kg_per_hour(watts: float, pue: float, kgco2_per_kwh: float) -> float:
    """kg CO2 per hour for a device drawing `watts` on a grid of `kgco2_per_kwh`."""
    return watts / 1000.0 * pue * kgco2_per_kwh


def green_rate(
    list_rate: float, energy_usd_h: float, carbon_kg_h: float, usd_per_tonne: float
) -> float:
    """A device- or core-hour's rate with its energy and carbon priced in, in this order."""
    return list_rate + energy_usd_h + carbon_kg_h * usd_per_tonne / 1000.0


def breakdown(
    duration_hours: float, hourly: float, egress: float = 0.0, latency: float = 0.0
) -> Breakdown:
    """The parts of an option whose hourly rate (`hourly_usd`) and other terms are known."""
    return Breakdown(compute_usd(duration_hours, hourly), egress, latency)
