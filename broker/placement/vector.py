"""feasibility's screen over the column index: every site of a large federation checked against a
request with numpy, filter by filter (broker.placement.feasibility.screen calls it from
columns.VECTOR_MIN_SITES sites up).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from broker.placement import request as fz
from broker.placement.columns import Bools, Dynamic, Floats, Ints, Static
from broker.placement.request import Request, Screen
from broker.placement.site import SiteOffer
from sites.model.catalog import SLICE_SEP


def screen(
    req: Request,
    sites: Sequence[SiteOffer],
    static: Static,
    dynamic: Dynamic,
    *,
    cheapest: bool,
) -> Screen:
    """feasibility.screen over columns (its docstring; first=False, no best-effort job)."""
    cols = dynamic.columns()

    n = len(sites)
    count = req.count
    check = req.check_capacity
    need, cpu_need, mem_need = (count, req.cpu, req.mem_gb) if check else (0, 0, 0.0)
    failed_masks: list[Bools | None] = [None] * len(fz.FILTERS)
    alive = cols.up.copy()
    failed_masks[fz.DOWN] = ~cols.up

    def stop(k: int, bad: Bools) -> None:
        nonlocal alive
        hit = alive & bad
        if hit.any():
            before = failed_masks[k]
            failed_masks[k] = hit if before is None else before | hit
            alive &= ~hit

    stop(fz.CORDONED, cols.cordoned)
    if req.allowed is not None or req.denied:
        ok_region = np.array(
            [
                (req.allowed is None or r in req.allowed) and r not in req.denied
                for r in static.region_index
            ],
            dtype=np.bool_,
        )
        stop(fz.REGION, ~ok_region[static.region])
    rtt: Floats | float = 0.0
    if req.rtts is not None:
        column = static.rtt_column(req.rtts)
        with np.errstate(invalid="ignore"):
            reachable = column <= req.max_latency_ms  # nan (no figure): False
        stop(fz.LATENCY, ~reachable)
        rtt = np.where(reachable, column, 0.0)
    # the model: the cheapest acceptable one with `need` free, ties to more free, then name;
    # at a site with nodes, also the cheapest one its nodes hold (broker.placement.nodes' fit test,
    # from the columns: `unknown` where they cannot tell, for node_choice to answer)
    on_nodes = alive & cols.has_nodes if check else None
    if on_nodes is not None and not on_nodes.any():
        on_nodes = None
    unknown = np.zeros(n, dtype=np.bool_)
    model_at = np.full(n, -1, dtype=np.int64)
    price = np.zeros(n, dtype=np.float64)
    free = cols.free_cpu.copy()  # devices of the model, or cores for a CPU-only job
    fits_n = np.ones(n, dtype=np.bool_)  # CPU-only: do the nodes hold the cores
    if count:
        names = static.models if req.named is None else sorted(set(req.named))
        offered = np.zeros(n, dtype=np.bool_)
        best_price = np.full(n, math.inf)
        best_have = np.full(n, -1, dtype=np.int64)
        node_price = np.full(n, math.inf)
        node_have = np.full(n, -1, dtype=np.int64)
        node_model = np.full(n, -1, dtype=np.int64)
        floor = req.min_mem_gb
        share = req.share
        for name in names:
            m = static.model_index.get(name)
            if m is None:
                continue
            p = static.price[m]
            have = cols.free[m]
            acceptable = (have >= 0) & ~np.isnan(p)
            if floor is not None:
                acceptable &= static.gpu_mem[m] >= floor
            whole_model = share is not None and SLICE_SEP not in name
            if whole_model:  # a share on a sharing pool's device: the loop's rules
                pools = static.sharing_column(name, sites)
                acceptable, have, p = _shared(
                    req, sites, name, acceptable & pools, have, p, static.gpu_mem[m]
                )
            offered |= acceptable
            enough = acceptable & (have >= need)
            better = enough & ((p < best_price) | ((p == best_price) & (have > best_have)))
            best_price = np.where(better, p, best_price)
            best_have = np.where(better, have, best_have)
            model_at = np.where(better, m, model_at)
            if on_nodes is not None:
                holds, unsure = cols.holds(m, req, on_nodes & enough)
                if whole_model:
                    # a share: a node with a whole device free holds it; else a partly used
                    # device may, which node_choice answers site by site
                    unsure = unsure | (on_nodes & enough & ~holds)
                unknown |= unsure
                here = enough & (holds | ~cols.has_nodes)
                better = here & ((p < node_price) | ((p == node_price) & (have > node_have)))
                node_price = np.where(better, p, node_price)
                node_have = np.where(better, have, node_have)
                node_model = np.where(better, m, node_model)
        stop(fz.MODEL, ~offered)
        stop(fz.GPUS, model_at < 0)
        price = np.where(model_at >= 0, best_price, 0.0)
        free = best_have
    elif on_nodes is not None:
        fits_n, unknown = cols.holds(len(static.models), req, on_nodes)
    stop(fz.CPU, cols.free_cpu < cpu_need)
    stop(fz.MEM, cols.free_mem < mem_need)
    if on_nodes is not None:
        at_nodes = alive & cols.has_nodes
        slow = at_nodes & unknown
        node_fail = np.zeros(n, dtype=np.bool_)
        models = static.models
        for i in np.flatnonzero(slow).tolist():
            m = int(model_at[i])
            model = None if m < 0 else models[m]
            fit = fz.node_choice(req, sites[i], model, float(price[i]), int(free[i]))
            if fit is None:
                node_fail[i] = True
            elif fit[0] != model and fit[0] is not None:
                model_at[i] = static.model_index[fit[0]]
                price[i] = fit[1]
                free[i] = fit[2]
        quick = at_nodes & ~unknown
        if count:
            node_fail |= quick & (node_model < 0)
            moved = quick & (node_model >= 0) & (node_model != model_at)
            model_at = np.where(moved, node_model, model_at)
            price = np.where(moved, node_price, price)
            free = np.where(moved, node_have, free)
        else:
            node_fail |= quick & ~fits_n
        stop(fz.NODES, node_fail)
    # the price, in pricing's order of operations (feasibility.screen writes the same)
    hourly = req.cpu * static.core_rate + req.mem_gb * static.mem_rate
    if count:
        hourly = hourly + count * price
    compute = req.duration_hours * hourly
    free_region = static.region_index.get(req.free_region) if req.free_region else None
    if free_region is None:
        egress: Floats | float = req.egress_away_usd
    else:
        egress = np.where(static.region == free_region, 0.0, req.egress_away_usd)
    latency = req.latency_weight * rtt
    cost = compute + egress + latency
    cost = np.broadcast_to(cost, (n,))
    stop(fz.BUDGET, cost > req.budget_usd)
    if req.late:
        stop(fz.DEADLINE, alive)
    if req.spread_taken:
        taken = np.isin(static.ids, list(req.spread_taken))
        stop(fz.SPREAD, taken)
    if req.colocate_at is not None:
        stop(fz.COLOCATE, static.ids != req.colocate_at)
    headroom = req.headroom
    if headroom is not None:
        at = np.flatnonzero(alive)
        if len(at):
            # one question per (model, region) pair, as the loop asks it
            n_regions = len(static.region_index)
            regions = tuple(static.region_index)
            pairs = (model_at[at] + 1) * n_regions + static.region[at]
            unique, inverse = np.unique(pairs, return_inverse=True)
            over: list[bool] = []
            for code in unique.tolist():
                mi, r = divmod(int(code), n_regions)
                model = static.models[mi - 1] if count and mi > 0 else None
                devices: float = count
                if req.share is not None and model is not None and SLICE_SEP not in model:
                    devices = req.share  # a share of one device counts its part
                over.append(
                    headroom.over(devices, model, req.cpu, req.mem_gb, regions[r]) is not None
                )
            bad_pair = np.array(over, dtype=np.bool_)
            quota = np.zeros(n, dtype=np.bool_)
            quota[at] = bad_pair[inverse]
            stop(fz.QUOTA, quota)
    if req.over_quota:
        stop(fz.QUOTA, alive)
    if req.over_gpu_hours:
        stop(fz.TENANT_BUDGET, alive)
    else:
        stop(fz.TENANT_BUDGET, cost > req.tenant_left_usd)
    ids = static.ids
    failed = [[] if mask is None else ids[mask].tolist() for mask in failed_masks]

    at = np.flatnonzero(alive)
    if cheapest and len(at) > 2:
        order = np.lexsort((static.sid_rank[at], -free[at], cost[at]))
        at = at[order[:2]]
    elif cheapest:
        order = np.lexsort((static.sid_rank[at], -free[at], cost[at]))
        at = at[order]
    models = static.models
    egress_at = np.broadcast_to(egress, (n,))
    latency_at = np.broadcast_to(latency, (n,))
    options = [
        (
            float(cost[i]),
            -int(free[i]),
            sites[i].id,
            sites[i],
            None if model_at[i] < 0 or not count else models[int(model_at[i])],
            float(compute[i]),
            float(egress_at[i]),
            float(latency_at[i]),
        )
        for i in at.tolist()
    ]
    return fz.Screen(options, failed, len(np.flatnonzero(alive)))


def _shared(
    req: Request,
    sites: Sequence[SiteOffer],
    name: str,
    acceptable: Bools,
    have: Ints,
    price: Floats,
    device_mem: Floats,
) -> tuple[Bools, Ints, Floats]:
    """A share request's (acceptable, free, price) columns for the whole model `name` at the
    sharing pools (`acceptable` already says which), as feasibility.screen_loop works them
    out: a device with the memory asked, free when a whole one is, or a partly used one has
    the room (one question per site that has none whole), priced at the share of the device."""
    share = req.share or 1.0
    room = share * device_mem if req.share_mem_gb is None else np.full(len(sites), req.share_mem_gb)
    acceptable = acceptable & (room <= device_mem + 1e-9)
    whole = have >= 1
    out = np.where(acceptable & whole, have, 0)
    for i in np.flatnonzero(acceptable & ~whole).tolist():
        shared = sites[i].shared
        if shared is not None and shared.holds(name, share, float(room[i])):
            out[i] = 1
    return acceptable, out, price * share
