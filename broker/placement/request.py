"""A job's terms as placement screens sites for it (Request), what a screen answers (Screen,
Option), the filters in the order they are tried, and whether a site's nodes hold a request.

Shared by the two screens: broker.placement.feasibility's site by site, and
broker.placement.vector's over the column index (broker.placement.columns).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from broker.placement.site import SiteOffer
from broker.placement.staging import StageTerms
from broker.placement.tenancy import Headroom

FILTERS: tuple[str, ...] = (
    "down",
    "cordoned",
    "region",
    "data",
    "latency",
    "model",
    "gpus",
    "cpu",
    "mem",
    "nodes",
    "budget",
    "deadline",
    "spread",
    "colocate",
    "quota",
    "tenant_budget",
)


(
    DOWN,
    CORDONED,
    REGION,
    DATA,
    LATENCY,
    MODEL,
    GPUS,
    CPU,
    MEM,
    NODES,
    BUDGET,
    DEADLINE,
    SPREAD,
    COLOCATE,
    QUOTA,
    TENANT_BUDGET,
) = range(len(FILTERS))


FITS = -1  # capacity(): no capacity filter failed


Offered = tuple[tuple[str, float], ...]  # (model, USD per device-hour) a site offers a request


# A feasible option: (cost USD, -free devices (cores for a CPU-only job), site id, the site,
# model, compute USD, egress USD, latency USD). Tuples order as placement ranks options (site
# ids are unique, so a comparison never reaches the offer).
Option = tuple[float, int, str, SiteOffer, str | None, float, float, float]


@dataclass(frozen=True, slots=True)
class Request:
    """A job's terms that do not depend on the site, worked out once per scan; valid for the
    snapshot lineage it was made from (`offered` is aligned with its sites)."""

    count: int  # devices of one model; 0 for a CPU-only job
    per_node: int | None  # devices on each node, at sites with nodes; None: the default shape
    cpu: int  # cores
    mem_gb: float  # GB of memory
    duration_hours: float  # hours the job runs
    named: tuple[str, ...] | None  # acceptable models; None: any
    min_mem_gb: float | None  # GB per device, the acceptable models' floor
    allowed: frozenset[str] | None  # allowed regions; None: any
    denied: frozenset[str]  # denied regions
    rtts: Mapping[str, float] | None  # site id -> user RTT ms; None: RTT not needed
    max_latency_ms: float  # inf when unlimited
    latency_weight: float  # USD per ms of user RTT
    free_region: str | None  # where moving the data costs nothing
    egress_away_usd: float  # USD to move the data anywhere else
    budget_usd: float  # inf when unlimited
    late: bool  # now + duration is past the deadline
    spread_taken: frozenset[str]  # site ids the job's spread group already uses
    colocate_at: str | None  # the site the job's colocate group lives on
    over_quota: bool  # the job's GPUs would put its tenant over its simple GPU quota
    headroom: Headroom | None  # the tenant's quota over cohorts, per (model, region); None: none
    tenant_left_usd: float  # what the tenant's monthly budget has left; inf when unlimited
    over_gpu_hours: bool  # the job's GPU-hours exceed what the tenant's window has left
    check_capacity: bool  # False: skip gpus, cpu and mem (the batch pass)
    best_effort: bool = False  # may use an oversubscribed site's spare capacity
    stage: StageTerms | None = None  # bringing the job's inputs to each site; None: no inputs
    slack_hours: float = math.inf  # hours between now + duration and the deadline
    share: float | None = None  # a share of one device's compute (count 1); None: whole ones
    share_mem_gb: float | None = None  # GB of its memory; None: the share of the device's


def on_nodes(
    site: SiteOffer,
    offered: Offered,
    count: int,
    per_node: int | None,
    cpu: int,
    mem_gb: float,
    model: str | None,
) -> tuple[str | None, float, int] | None:
    """The capacity part's choice at a site with nodes: `model` (the cheapest with enough
    free in all) when its nodes hold the request, else the next cheapest acceptable model
    whose nodes do; (model, USD per device-hour, free devices) or None."""
    nodes = site.nodes
    assert nodes is not None
    if nodes.fits(model, count, per_node, cpu, mem_gb):
        if model is None:
            return None, 0.0, site.free_cpu
        return model, site.prices.usd_per_gpu_hour.get(model, 0.0), site.free_gpus[model]
    if not count:
        return None
    free_gpus = site.free_gpus
    rest = sorted(
        (p, -have, name)
        for name, p in offered
        if name != model and (have := free_gpus.get(name, 0)) >= count
    )
    for p, minus_free, name in rest:
        if nodes.fits(name, count, per_node, cpu, mem_gb):
            return name, p, -minus_free
    return None


def node_choice(
    req: Request, site: SiteOffer, model: str | None, price: float, free: int
) -> tuple[str | None, float, int] | None:
    """The node filter at a site that declares its nodes, for a request whose capacity part
    chose `model` (USD per device-hour `price`, `free` devices; None: a CPU-only job) on the
    site's totals: the same (model, price, free) when its nodes hold it, else the next
    cheapest acceptable model whose nodes do, else None (the site fails `nodes`)."""
    nodes = site.nodes
    assert nodes is not None
    count, per_node, cpu, mem = req.count, req.per_node, req.cpu, req.mem_gb
    shared = site.shared
    if req.share is not None and shared is not None and model is not None and model in shared.modes:
        # a share of a sharing pool's device: a node with a whole one free, or a device with
        # shares and the room, on a node with the cores and memory
        if nodes.fits(model, 1, None, cpu, mem):
            return model, price, free
        room = share_room(req, site, model)
        for (node, m), on in shared.parts.items():
            if m != model or node is None:
                continue
            n = nodes.nodes[nodes.position(node)]
            if n.cpu >= cpu and n.mem_gb >= mem - 1e-9:
                if any(c >= req.share - 1e-9 and g >= room - 1e-9 for c, g in on.values()):
                    return model, price, free
        return None
    if per_node is None and count <= nodes.size.get(model, 0):  # type: ignore[arg-type]
        # one node: exact from the nodes' frontier (one entry at most sites)
        floor_mem = mem - 1e-9
        for have, node_cpu, node_mem in nodes.frontier.get(model, ()):
            if have >= count and node_cpu >= cpu and node_mem >= floor_mem:
                return model, price, free
    else:  # several nodes: nodes.fits, whose answers are remembered on the nodes
        answers = nodes.held.get((count, per_node, cpu, mem))
        known = None if answers is None else answers.get(model)
        if known is None:
            known = nodes.fits(model, count, per_node, cpu, mem)
        if known:
            return model, price, free
    if not count:
        return None
    # the cheapest model with the devices in all is scattered over the nodes: the next
    # cheapest acceptable one whose nodes hold the request
    named, floor = req.named, req.min_mem_gb
    ranked = nodes.ranked((count, per_node, cpu, mem), site.free_gpus, site.prices.usd_per_gpu_hour)
    for p, minus_free, other in ranked:
        if named is not None and other not in named:
            continue
        if floor is not None and site.gpu_mem_gb.get(other, 0.0) < floor:
            continue
        return other, p, -minus_free
    return None


def share_room(req: Request, site: SiteOffer, model: str) -> float:
    """The device memory (GB) a share request holds on `model` at `site`."""
    if req.share_mem_gb is not None:
        return req.share_mem_gb
    return round((req.share or 1.0) * site.gpu_mem_gb.get(model, 0.0), 6)


@dataclass(slots=True)
class Screen:
    """What `screen` found: feasible options in site order (`Option`), and per filter (FILTERS
    order) the ids of the sites it stopped, in site order."""

    options: list[Option]
    failed: list[list[str]]
    feasible: int = 0  # feasible sites (with cheapest=True, more than `options` holds)

    def reasons(self) -> dict[str, list[str]]:
        """filter name -> site ids stopped there, for the filters that stopped any."""
        return {name: ids for name, ids in zip(FILTERS, self.failed, strict=True) if ids}
