"""A snapshot's sites as columns (numpy arrays), and broker.placement.feasibility's filter over
them.

At a thousand sites the filter's per-site Python loop is most of a submit (about 1-2 us a
site). Here the same filters run a column at a time: each a few numpy operations over every
site, whatever the federation's size; only the node fit (broker.placement.nodes, per site by nature)
and the quota over cohorts (one call per (model, region) pair, as the loop does) stay in
Python, for the sites still standing when they come. `feasibility.screen` calls `screen` for
federations of VECTOR_MIN_SITES sites or more (below that the loop is cheaper than numpy's
fixed cost per operation); the two give the same options, failed lists and counts
(tests/broker/placement/test_columns.py holds them equal on random federations).

Columns come in two parts. `Static`: what a snapshot lineage never changes (ids, regions,
prices, device memory; broker.placement.offers' `_Index` keeps it). `Dynamic`: free capacity and
state, per snapshot. `Federation.with_offer` does not copy them: it records the one changed offer,
and the next `dynamic()` applies the changes since the last snapshot that had its columns
(a bounded chain), so a submit's apply stays O(1) here.

Pure: no I/O. Floating-point sums are formed in the loop's very order, so costs are equal to
the bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from broker.placement.request import Request
from broker.placement.site import SiteOffer

__all__ = ["VECTOR_MIN_SITES", "Dynamic", "Static"]

VECTOR_MIN_SITES = 400
MAX_CHAIN = 64  # changed offers a snapshot may lag its last columns by before a rebuild
FRONTIER_ROWS = 4  # rows of a nodes' frontier the columns hold (broker.placement.nodes.NodesFree)
GE_MAX = 8  # devices per node up to which the columns count nodes by free devices

Bools = npt.NDArray[np.bool_]
Ints = npt.NDArray[np.int64]
Small = npt.NDArray[np.int32]  # counts of devices and nodes
ARRAYS = (
    "up",
    "cordoned",
    "free_cpu",
    "free_mem",
    "free",
    "has_nodes",
    "node_size",
    "fr_rows",
    "fr_have",
    "fr_cpu",
    "fr_mem",
    "ge",
    "floor_cpu",
    "floor_mem",
    "ceiling_cpu",
    "ceiling_mem",
)
Floats = npt.NDArray[np.float64]


class Static:
    """What a snapshot lineage never changes, as columns."""

    __slots__ = (
        "core_rate",
        "gpu_mem",
        "ids",
        "mem_rate",
        "model_index",
        "models",
        "price",
        "region",
        "region_index",
        "rtt",
        "sharing",
        "sid_rank",
    )

    def __init__(self, sites: Sequence[SiteOffer]) -> None:
        self.ids = np.array([site.id for site in sites], dtype=object)
        order = sorted(range(len(sites)), key=lambda i: sites[i].id)
        rank = np.empty(len(sites), dtype=np.int64)
        rank[order] = np.arange(len(sites), dtype=np.int64)
        self.sid_rank = rank
        regions = sorted({site.region for site in sites})
        self.region_index = {r: i for i, r in enumerate(regions)}
        self.region = np.array([self.region_index[site.region] for site in sites], np.int64)
        # every model any site lists, sorted: the loop's tie-break on the name is then the
        # first of equals in this order
        self.models = tuple(sorted({m for site in sites for m in site.free_gpus}))
        self.model_index = {m: i for i, m in enumerate(self.models)}
        nan = math.nan
        self.price = np.array(
            [[site.prices.usd_per_gpu_hour.get(m, nan) for site in sites] for m in self.models],
            dtype=np.float64,
        ).reshape(len(self.models), len(sites))
        self.gpu_mem = np.array(
            [[site.gpu_mem_gb.get(m, 0.0) for site in sites] for m in self.models],
            dtype=np.float64,
        ).reshape(len(self.models), len(sites))
        self.core_rate = np.array([s.prices.usd_per_core_hour for s in sites], np.float64)
        self.mem_rate = np.array([s.prices.usd_per_gb_mem_hour for s in sites], np.float64)
        # id of a user-region RTT mapping (Federation.rtt_from's, stable in a lineage) -> the
        # mapping (kept, so the id is not reused) and its column (nan: no figure)
        self.rtt: dict[int, tuple[Mapping[str, float], Floats]] = {}
        # model -> the sites whose pool of it is a sharing pool (broker.placement.sharing),
        # worked out when first asked: a lineage keeps every site's modes (offers'
        # _chain_columns)
        self.sharing: dict[str, Bools] = {}

    def sharing_column(self, model: str, sites: Sequence[SiteOffer]) -> Bools:
        known = self.sharing.get(model)
        if known is None:
            known = self.sharing[model] = np.fromiter(
                ((sh := site.shared) is not None and model in sh.modes for site in sites),
                dtype=np.bool_,
                count=len(sites),
            )
        return known

    def rtt_column(self, rtts: Mapping[str, float]) -> Floats:
        known = self.rtt.get(id(rtts))
        if known is None or known[0] is not rtts:
            column = np.array([rtts.get(i, math.nan) for i in self.ids], dtype=np.float64)
            known = self.rtt[id(rtts)] = (rtts, column)
        return known[1]


class Dynamic:
    """One snapshot's free capacity and state (its `Columns`). The snapshots of a lineage
    share one set of arrays, which hold the values of one of them (the owner); every other
    keeps what to undo to get from the next one's values to its own (Baker's rerooting
    persistent arrays). `changed` makes the next snapshot's values in place, saving the
    changed sites' old values, so an apply costs its own sites, not a copy of every column;
    reading an older snapshot's columns puts its values back first."""

    __slots__ = ("_cols", "_next", "_undo", "static")

    def __init__(self, static: Static, cols: Columns) -> None:
        self.static = static
        self._cols = cols
        self._next: Dynamic | None = None  # the snapshot this one's undo leads from
        self._undo: dict[int, _Saved] = {}

    @classmethod
    def of(cls, static: Static, sites: Sequence[SiteOffer]) -> Dynamic | None:
        """None when a site lists a model its lineage's Static does not know."""
        cols = Columns(static, len(sites))
        for pos, site in enumerate(sites):
            if not cols.set(pos, site):
                return None
        out = cls(static, cols)
        cols.owner = out
        return out

    def columns(self) -> Columns:
        """The arrays, holding this snapshot's values."""
        cols = self._cols
        if cols.owner is not self:
            path: list[Dynamic] = []
            at: Dynamic = self
            while cols.owner is not at:
                path.append(at)
                assert at._next is not None
                at = at._next
            for older in reversed(path):  # each undo turns its next one's values into its own
                older.reroot_from_next()
        return cols

    def reroot_from_next(self) -> None:
        """Take the arrays from the next snapshot (their owner): put this one's values back,
        and leave the next one what takes them forward again."""
        cols, newer = self._cols, self._next
        assert newer is not None and cols.owner is newer
        redo = {pos: cols.take(pos) for pos in self._undo}
        for pos, saved in self._undo.items():
            cols.put(pos, saved)
        newer.follow(self, redo)
        self._next, self._undo = None, {}
        cols.owner = self

    def follow(self, older: Dynamic, redo: dict[int, _Saved]) -> None:
        self._next, self._undo = older, redo

    def changed(self, offers: Mapping[int, SiteOffer]) -> Dynamic | None:
        """The next snapshot: these columns with the offers at these positions replaced;
        None when an offer lists a model the lineage does not know (then the caller
        rebuilds, and these columns are as they were)."""
        cols = self.columns()
        undo = {pos: cols.take(pos) for pos in offers}
        for pos, site in offers.items():
            if not cols.set(pos, site):
                for back, saved in undo.items():
                    cols.put(back, saved)
                return None
        out = Dynamic(self.static, cols)
        self._next, self._undo = out, undo
        cols.owner = out
        return out


_Saved = tuple[npt.NDArray[Any], ...]  # one site's values in every array, in ARRAYS order


class Columns:
    """The arrays. free[m] (a row per model, in Static.models order) is -1 where the site does
    not list model m. What broker.placement.nodes' fit test reads, at sites with nodes, per model
    row and a last row for cores only: node_size (the most devices of the model one node has),
    the first FRONTIER_ROWS rows of the nodes' frontier (fr_have, fr_cpu, fr_mem; fr_rows:
    how many it has), ge[d] (nodes with at least d free, d <= GE_MAX), and per site the
    fewest and most free cores and GB a node has. Where these cannot answer (a longer
    frontier, bigger nodes, a node-by-node scan) `holds` says so and the site goes through
    feasibility.node_choice. The last axis is always the site."""

    __slots__ = (*ARRAYS, "owner", "static")

    up: Bools
    cordoned: Bools
    free_cpu: Ints
    free_mem: Floats
    free: Ints  # (models, sites)
    has_nodes: Bools
    node_size: Small  # (models + 1, sites)
    fr_rows: Small  # (models + 1, sites)
    fr_have: Small  # (models + 1, FRONTIER_ROWS, sites)
    fr_cpu: Ints
    fr_mem: Floats
    ge: Small  # (models + 1, GE_MAX + 1, sites)
    floor_cpu: Ints
    floor_mem: Floats
    ceiling_cpu: Ints
    ceiling_mem: Floats

    def __init__(self, static: Static, n: int) -> None:
        rows = len(static.models) + 1
        self.static = static
        self.owner: Dynamic | None = None
        self.up = np.zeros(n, dtype=np.bool_)
        self.cordoned = np.zeros(n, dtype=np.bool_)
        self.free_cpu = np.zeros(n, dtype=np.int64)
        self.free_mem = np.zeros(n, dtype=np.float64)
        self.free = np.full((rows - 1, n), -1, dtype=np.int64)
        self.has_nodes = np.zeros(n, dtype=np.bool_)
        self.node_size = np.zeros((rows, n), dtype=np.int32)
        self.fr_rows = np.zeros((rows, n), dtype=np.int32)
        self.fr_have = np.full((rows, FRONTIER_ROWS, n), -1, dtype=np.int32)
        self.fr_cpu = np.full((rows, FRONTIER_ROWS, n), -1, dtype=np.int64)
        self.fr_mem = np.full((rows, FRONTIER_ROWS, n), -math.inf, dtype=np.float64)
        self.ge = np.zeros((rows, GE_MAX + 1, n), dtype=np.int32)
        self.floor_cpu = np.zeros(n, dtype=np.int64)
        self.floor_mem = np.zeros(n, dtype=np.float64)
        self.ceiling_cpu = np.zeros(n, dtype=np.int64)
        self.ceiling_mem = np.zeros(n, dtype=np.float64)

    def take(self, pos: int) -> _Saved:
        return tuple(getattr(self, name)[..., pos].copy() for name in ARRAYS)

    def put(self, pos: int, saved: _Saved) -> None:
        for name, values in zip(ARRAYS, saved, strict=True):
            getattr(self, name)[..., pos] = values

    def set(self, pos: int, site: SiteOffer) -> bool:
        """Write one site's values; False when it lists a model the static part lacks."""
        return self._set(pos, site)

    def _set(self, pos: int, site: SiteOffer) -> bool:
        index = self.static.model_index
        self.up[pos] = site.up
        self.cordoned[pos] = site.cordoned
        self.free_cpu[pos] = site.free_cpu
        self.free_mem[pos] = site.free_mem_gb
        self.free[:, pos] = -1
        for model, have in site.free_gpus.items():
            m = index.get(model)
            if m is None:
                return False
            self.free[m, pos] = have
        nodes = site.nodes
        self.has_nodes[pos] = nodes is not None
        self.node_size[:, pos] = 0
        self.fr_rows[:, pos] = 0
        self.fr_have[:, :, pos] = -1
        self.fr_cpu[:, :, pos] = -1
        self.fr_mem[:, :, pos] = -math.inf
        self.ge[:, :, pos] = 0
        if nodes is None:
            return True
        self.floor_cpu[pos], self.floor_mem[pos] = nodes.floor_cpu, nodes.floor_mem_gb
        self.ceiling_cpu[pos], self.ceiling_mem[pos] = nodes.ceiling_cpu, nodes.ceiling_mem_gb
        cores = len(index)  # the cores-only row
        for on_nodes, frontier in nodes.frontier.items():
            m = cores if on_nodes is None else index.get(on_nodes)
            if m is None:
                return False
            size = 0 if on_nodes is None else nodes.size.get(on_nodes, 0)
            self.node_size[m, pos] = size
            self.fr_rows[m, pos] = len(frontier)
            for r, (have, cpu, mem) in enumerate(frontier[:FRONTIER_ROWS]):
                self.fr_have[m, r, pos], self.fr_cpu[m, r, pos], self.fr_mem[m, r, pos] = (
                    have,
                    cpu,
                    mem,
                )
            if on_nodes is not None and size <= GE_MAX:
                self.ge[m, : size + 1, pos] = nodes.at_least(on_nodes)[: size + 1]
        return True

    def holds(self, row: int, req: Request, where: Bools) -> tuple[Bools, Bools]:
        """broker.placement.nodes.NodesFree.fits of the request with model `row` (the cores-only row
        for a CPU-only job) at every site, from the columns: (holds, unknown), both False
        outside `where`; `unknown`: the columns cannot tell (then ask the site's nodes)."""
        n = len(where)
        holds = np.zeros(n, dtype=np.bool_)
        unknown = np.zeros(n, dtype=np.bool_)
        at = np.flatnonzero(where)
        if not len(at):
            return holds, unknown
        count, per_node, cpu, mem = req.count, req.per_node, req.cpu, req.mem_gb
        k = len(at)
        size = self.node_size[row, at]
        most = self.fr_have[row, 0, at]
        if row == len(self.static.models) or count == 0:
            big = small = np.zeros(k, dtype=np.int64)
            need = np.ones(k, dtype=np.int64)
            valid = np.ones(k, dtype=np.bool_)
        elif per_node is not None:
            valid = size >= per_node
            big = small = np.full(k, per_node, dtype=np.int64)
            need = np.full(k, count // per_node, dtype=np.int64)
        else:
            valid = size > 0
            whole, rest = np.divmod(count, np.maximum(size, 1))
            single = count <= size
            big = np.where(single, count, size)
            small = np.where(single, count, np.where(rest > 0, rest, size))
            need = np.where(single, 1, whole + (rest > 0))
        valid &= most >= big  # no node has that many free: False
        one = valid & (need == 1)
        several = valid & (need > 1)
        got = np.zeros(k, dtype=np.bool_)
        unsure = np.zeros(k, dtype=np.bool_)
        if one.any():
            # one node: the frontier, exactly, when it has at most FRONTIER_ROWS rows
            fr_ok = (
                (self.fr_have[row][:, at] >= big)
                & (self.fr_cpu[row][:, at] >= cpu)
                & (self.fr_mem[row][:, at] >= mem - 1e-9)
            ).any(axis=0)
            got |= one & fr_ok
            unsure |= one & ~fr_ok & (self.fr_rows[row, at] > FRONTIER_ROWS)
        if several.any():
            # broker.placement.nodes._split: a part's cores and GB in proportion to its devices
            cpu_big = np.ceil(cpu * big / count)
            mem_big = mem * big / count
            cpu_small = np.ceil(cpu * small / count)
            mem_small = mem * small / count
            room = (cpu_small <= self.ceiling_cpu[at]) & (mem_small <= self.ceiling_mem[at] + 1e-9)
            every = (self.floor_cpu[at] >= cpu_big) & (self.floor_mem[at] >= mem_big - 1e-9)
            ge = self.ge[row][:, at]
            cols = np.arange(k)
            counted = (
                ge[np.minimum(big, GE_MAX), cols] >= np.where(small == big, need, need - 1)
            ) & (ge[np.minimum(small, GE_MAX), cols] >= need)
            exact = size <= GE_MAX
            got |= several & room & exact & counted & every
            unsure |= several & room & (~exact | (counted & ~every))
        holds[at] = got
        unknown[at] = unsure
        return holds, unknown
