"""Nodes inside a site (资源拓扑感知): the fit test and the choice of nodes, one place.

A site that declares its nodes (sites.model.spec.Topology) is not one pool: a job's devices must sit
on nodes that have them free, and a multi-node job or a gang should stay inside one fabric
island (NVLink domain, InfiniBand island). `NodesFree` is what a site's nodes have free now;
`shape` turns a request into per-node demands; `fits` answers "can this site take it" (the
filter broker.placement.feasibility runs, cheap: most sites answer from `most`); `choose` picks the
nodes
(best fit by default: the fullest nodes that still fit, so that whole nodes stay free for large
jobs; `spread`: the emptiest, as Kubernetes' default LeastAllocated score does; a one-node
request with `pack` is placed by broker.placement.sharing.choose_node instead, fragmentation
first). The fast path, the batch pass's commit, the simulator and the agent's allocation read
the same shapes.

Shapes: `per_node` devices on each of count / per_node nodes when the job says so; else one
node when one node of the site has that many devices of the model, else whole nodes (the
node size, the last one with the remainder). Cores and memory are split in proportion to the
devices (a CPU-only job takes one node). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from sites.model.assignments import NodeShare
from sites.model.spec import SiteSpec

__all__ = [
    "Chosen",
    "Node",
    "NodesFree",
    "Packing",
    "Shape",
    "shape",
]

Packing = Literal["pack", "spread"]
Shape = tuple[int, int | None, int, float]  # a request: (devices, per_node, cores, GB)
MEMO_SHAPES = 1024  # request shapes a site's nodes remember answers for, then start afresh
_EMPTY: Mapping[str, int] = MappingProxyType({})
_NONE: tuple[Mapping[str, int], int, float] = (_EMPTY, 0, 0.0)


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    island: str | None
    gpus: Mapping[str, int]  # free devices by (pseudo-)model
    cpu: int
    mem_gb: float


@dataclass(frozen=True, slots=True)
class Chosen:
    """Where a job's devices go: one share per node, the island they share (None: no island
    holds them all, or the site declares none) and whether they span islands."""

    shares: tuple[NodeShare, ...]
    island: str | None
    spans: bool

    def describe(self, model: str | None) -> str:
        what = model or "cores"
        nodes = ", ".join(
            f"{s.node} ({s.gpus} x {what})" if s.gpus else f"{s.node} ({s.cpu} cores)"
            for s in self.shares[:4]
        )
        if len(self.shares) > 4:
            nodes += f" and {len(self.shares) - 4} more"
        where = f"node {nodes}" if len(self.shares) == 1 else f"nodes {nodes}"
        if self.spans:
            return f"{where}, across islands (no single island had room)"
        if self.island is not None:
            return f"{where} in island {self.island}"
        return where


class NodesFree:
    """What one site's nodes have free, with their sizes (from the spec). A value: `taken`
    and `given` return new ones."""

    __slots__ = (
        "frontier",
        "_by_name",
        "_islands",
        "_ranked",
        "ceiling_cpu",
        "ceiling_mem_gb",
        "floor_cpu",
        "floor_mem_gb",
        "_ge",
        "held",
        "most",
        "nodes",
        "packing",
        "size",
    )

    def __init__(
        self,
        nodes: tuple[Node, ...],
        size: Mapping[str, int],
        packing: Packing = "pack",
        counts: dict[str, list[int]] | None = None,
    ) -> None:
        self.nodes = nodes
        self.size = size  # model -> the most devices of it one node has (free or not)
        self.packing: Packing = packing
        # built here, with the offer (the view's work at a bounded rate), not on a submit:
        # how many nodes have at least d free of each model (`moved` passes them updated)
        if counts is None:
            counts = {m: [0] * (n + 2) for m, n in size.items()}
            for node in nodes:
                for model, n in node.gpus.items():
                    row = counts.get(model)
                    if row is not None:
                        row[min(n, len(row) - 2)] += 1
            for row in counts.values():
                for d in range(len(row) - 3, -1, -1):
                    row[d] += row[d + 1]
        # model -> the most free on one node
        self.most = {
            m: next((d for d in range(len(row) - 2, -1, -1) if row[d]), 0)
            for m, row in counts.items()
        }
        # model (None: cores only) -> the nodes' (free devices, cores, GB) that no other node
        # has as much of in all three: a one-node request fits iff one of these holds it;
        # worked out per model when first read (a move makes a new one)
        self.frontier: Mapping[str | None, tuple[tuple[int, int, float], ...]] = _Frontiers(
            nodes, size
        )
        # the fewest and the most free cores and GB a node has: when a part's cores and
        # memory are at most the floors, the devices alone decide (broker.placement.feasibility's
        # shortcut); above the ceilings, no node holds it
        self.floor_cpu = min((node.cpu for node in nodes), default=0)
        self.floor_mem_gb = min((node.mem_gb for node in nodes), default=0.0)
        self.ceiling_cpu = max((node.cpu for node in nodes), default=0)
        self.ceiling_mem_gb = max((node.mem_gb for node in nodes), default=0.0)
        self._by_name: dict[str, int] | None = None
        self._islands: dict[str | None, list[int]] | None = None  # island -> node positions
        self._ge = counts
        # (count, per_node, cpu, GB) -> model -> do the nodes hold it (`fits`); read by
        # broker.placement.feasibility.screen directly, two dict lookups per site
        self.held: dict[Shape, dict[str | None, bool]] = {}
        self._ranked: dict[Shape, tuple[Mapping[str, int], tuple[tuple[float, int, str], ...]]] = {}

    @classmethod
    def of_spec(
        cls,
        spec: SiteSpec,
        held: Mapping[str, tuple[Mapping[str, int], int, float]] | None = None,
        *,
        pools: Mapping[str, Mapping[str, int]] | None = None,
        packing: Packing = "pack",
    ) -> NodesFree | None:
        """The spec's nodes less `held` (node -> (devices by model, cores, GB)); None for a
        site that declares no nodes. `pools`: node -> devices by (pseudo-)model as placement
        sees them (a partitioned device's slices), default the spec's devices."""
        topology = spec.topology
        if topology is None:
            return None
        nodes: list[Node] = []
        size: dict[str, int] = {}
        for group in topology.nodes:
            for i, name in enumerate(group.node_names()):
                devices = group.devices if pools is None else pools.get(name, group.devices)
                used, cpu, mem = (_EMPTY, 0, 0.0) if held is None else held.get(name, _NONE)
                free = {m: max(0, n - used.get(m, 0)) for m, n in devices.items()}
                for model, n in devices.items():
                    if n > size.get(model, 0):
                        size[model] = n
                nodes.append(
                    Node(
                        name,
                        group.island_of(i),
                        free,
                        max(0, group.cpu_cores - cpu),
                        max(0.0, round(group.mem_gb - mem, 6)),
                    )
                )
        return cls(tuple(nodes), size, packing)

    def at_least(self, model: str) -> Sequence[int]:
        """[d] -> how many nodes have at least d free devices of the model (d up to the
        node size; broker.placement.columns reads it)."""
        return self._ge.get(model, ())

    def position(self, name: str) -> int:
        by_name = self._by_name
        if by_name is None:
            by_name = self._by_name = {node.name: i for i, node in enumerate(self.nodes)}
        return by_name[name]

    # -- the fit test -------------------------------------------------------------------

    def fits(
        self, model: str | None, count: int, per_node: int | None, cpu: int, mem: float
    ) -> bool:
        """Can these nodes hold the request with `model` now (the same answer as `choose` is
        not None)? `model` None: a CPU-only request (count 0). Every site that passes the
        totals asks, so answers are remembered on these nodes, per request shape and model
        (`held`: a value does not change, and job shapes repeat), for at most MEMO_SHAPES
        shapes, then afresh."""
        request = (count, per_node, cpu, mem)
        answers = self.held.get(request)
        if answers is None:
            if len(self.held) >= MEMO_SHAPES:
                self.held.clear()
            answers = self.held[request] = {}
        known = answers.get(model)
        if known is None:
            known = answers[model] = self._fits(model, count, per_node, cpu, mem)
        return known

    def ranked(
        self, request: Shape, free: Mapping[str, int], prices: Mapping[str, float]
    ) -> tuple[tuple[float, int, str], ...]:
        """(USD per device-hour, minus free devices, model) of the site's models whose nodes
        hold the request and whose free devices in all (`free`, the site's) have its count,
        cheapest first, ties to more free devices, then the name: broker.placement.feasibility's
        next model when the cheapest is scattered over the nodes. Remembered like `fits`, while
        the site's free devices are the same object."""
        known = self._ranked.get(request)
        if known is not None and known[0] is free:
            return known[1]
        count, per_node, cpu, mem = request
        order = tuple(
            sorted(
                (p, -have, model)
                for model in self.size
                if (have := free.get(model, 0)) >= count
                and (p := prices.get(model)) is not None
                and self.fits(model, count, per_node, cpu, mem)
            )
        )
        if len(self._ranked) >= MEMO_SHAPES:
            self._ranked.clear()
        self._ranked[request] = (free, order)
        return order

    def _fits(
        self, model: str | None, count: int, per_node: int | None, cpu: int, mem: float
    ) -> bool:
        # the request's parts (shape(), without the list): k nodes that hold `big`, `need`
        # in all, the last `small`
        if model is None or count == 0:
            model = None
            big = small = 0
            need = 1
        else:
            biggest = self.size.get(model, 0)
            if per_node is not None:
                if per_node > biggest:
                    return False
                big = small = per_node
                need = count // per_node
            elif biggest == 0:
                return False
            elif count <= biggest:
                big = small = count
                need = 1
            else:
                big = biggest
                whole, small = divmod(count, biggest)
                need = whole + 1 if small else whole
                small = small or biggest
        k = need if small == big else need - 1
        if model is not None and self.most.get(model, 0) < big:
            return False  # no node has that many free: most sites answer here
        if need == 1:  # one node: exact from the frontier (one entry at most sites)
            mem -= 1e-9
            return any(
                have >= big and node_cpu >= cpu and node_mem >= mem
                for have, node_cpu, node_mem in self.frontier[model]
            )
        cpu_big, mem_big = _split(cpu, mem, big, count)
        cpu_small, mem_small = _split(cpu, mem, small, count)
        if cpu_small > self.ceiling_cpu or mem_small > self.ceiling_mem_gb + 1e-9:
            return False  # no node has the cores or the memory for even the smallest part
        every = self.floor_cpu >= cpu_big and self.floor_mem_gb >= mem_big - 1e-9
        if model is None:
            if every:
                return bool(self.nodes)
        else:
            ge = self._ge[model]  # [d] -> nodes with at least d free
            if ge[big] < k or ge[small] < need:
                return False
            if every:
                return True  # every node has the cores and memory: the devices decide
        return self._scan(model, big, small, k, need, count, cpu, mem)

    def _scan(
        self,
        model: str | None,
        big: int,
        small: int,
        k: int,
        need: int,
        count: int,
        cpu: int,
        mem: float,
    ) -> bool:
        """fits() node by node: `k` nodes that hold `big` (cores and memory too), `need` in
        all that hold at least `small` (a node that holds `big` holds `small`, so counting
        both is enough, in any order; remembered by `fits`, so no sort is kept)."""
        cpu_big, mem_big = _split(cpu, mem, big, count)
        cpu_small, mem_small = _split(cpu, mem, small, count)
        mem_big -= 1e-9
        mem_small -= 1e-9
        n_big = n_small = 0
        for node in self.nodes:
            have = 0 if model is None else node.gpus.get(model, 0)
            if have < small:
                continue
            node_cpu, node_mem = node.cpu, node.mem_gb
            if have >= big and node_cpu >= cpu_big and node_mem >= mem_big:
                n_big += 1
                n_small += 1
            elif node_cpu >= cpu_small and node_mem >= mem_small:
                n_small += 1
            else:
                continue
            if n_big >= k and n_small >= need:
                return True
        return False

    # -- the choice ---------------------------------------------------------------------

    def choose(
        self,
        model: str | None,
        count: int,
        per_node: int | None,
        cpu: int,
        mem: float,
        prefer_island: str | None = None,
    ) -> Chosen | None:
        """The nodes for the request: inside one island when one can hold it all (the
        preferred island first, then the fullest island that fits, by the packing rule), else
        across islands; None when the nodes cannot hold it."""
        demands = shape(self.size, model, count, per_node)
        if demands is None:
            return None
        islands = self._islands
        if islands is None:  # the nodes' islands never change: shared by `moved` copies
            islands = self._islands = {}
            for i, node in enumerate(self.nodes):
                islands.setdefault(node.island, []).append(i)
        order = sorted(
            islands,
            key=lambda isl: (
                isl != prefer_island,
                self._room(islands[isl], model) * (1 if self.packing == "pack" else -1),
                "" if isl is None else isl,
            ),
        )
        for island in order:
            picked = self._assign(islands[island], model, demands, count, cpu, mem)
            if picked is not None:
                return Chosen(picked, island, False)
        if len(islands) > 1:
            picked = self._assign(range(len(self.nodes)), model, demands, count, cpu, mem)
            if picked is not None:
                return Chosen(picked, None, True)
        return None

    def choose_together(
        self, parts: Sequence[tuple[str | None, int, int | None, int, float]]
    ) -> list[Chosen] | None:
        """Nodes for several jobs (a gang's members at this site: (model, count, per_node,
        cpu, mem) each) inside one island, the island chosen by the packing rule; None when
        no island holds them all."""
        islands = sorted(
            {node.island for node in self.nodes}, key=lambda isl: "" if isl is None else isl
        )
        models = {part[0] for part in parts}
        order = sorted(
            islands,
            key=lambda isl: (
                sum(
                    self._room([i for i, n in enumerate(self.nodes) if n.island == isl], m)
                    for m in models
                )
                * (1 if self.packing == "pack" else -1),
                "" if isl is None else isl,
            ),
        )
        for island in order:
            left = self
            out: list[Chosen] = []
            for model, count, per_node, cpu, mem in parts:
                members = [i for i, n in enumerate(left.nodes) if n.island == island]
                demands = shape(left.size, model, count, per_node)
                picked = (
                    None
                    if demands is None
                    else left._assign(members, model, demands, count, cpu, mem)
                )
                if picked is None:
                    break
                out.append(Chosen(picked, island, False))
                left = left.moved(model, picked, -1)
            else:
                return out
        return None

    def _room(self, members: Sequence[int], model: str | None) -> int:
        nodes = self.nodes
        if model is None:
            return sum(nodes[i].cpu for i in members)
        return sum(nodes[i].gpus.get(model, 0) for i in members)

    def _assign(
        self,
        members: Iterable[int],
        model: str | None,
        demands: Sequence[int],
        count: int,
        cpu: int,
        mem: float,
    ) -> tuple[NodeShare, ...] | None:
        nodes = self.nodes
        sign = 1 if self.packing == "pack" else -1
        free = list(members)
        shares: list[NodeShare] = []
        for d in demands:
            c, m = _split(cpu, mem, d, count)
            best: tuple[tuple[float, ...], int] | None = None
            for i in free:
                node = nodes[i]
                have = node.gpus.get(model, 0) if model is not None else 0
                if have < d or node.cpu < c or node.mem_gb < m - 1e-9:
                    continue
                key = (sign * have, sign * node.cpu, sign * node.mem_gb, i)
                if best is None or key < best[0]:
                    best = (key, i)
            if best is None:
                return None
            i = best[1]
            free.remove(i)
            shares.append(NodeShare(node=nodes[i].name, gpus=d, cpu=c, mem_gb=m))
        return tuple(shares)

    # -- taking and giving back -----------------------------------------------------------

    def moved(self, model: str | None, shares: Iterable[NodeShare], sign: int) -> NodesFree:
        """The nodes after a job's shares are taken (sign=-1) or given back (sign=1)."""
        nodes = list(self.nodes)
        counts = self._ge
        copied = False
        for share in shares:
            i = self.position(share.node)
            node = nodes[i]
            gpus = node.gpus
            if model is not None and share.gpus:
                was = gpus.get(model, 0)
                gpus = {**gpus, model: was + sign * share.gpus}
                row = counts.get(model)
                if row is not None:  # the node's row of `at_least`, moved from was to now
                    if not copied:
                        counts = {m: list(r) for m, r in counts.items()}
                        row = counts[model]
                        copied = True
                    top = len(row) - 2
                    now = gpus[model]
                    for d in range(min(was, now, top) + 1, min(max(was, now), top) + 1):
                        row[d] += 1 if now > was else -1
            nodes[i] = Node(
                node.name,
                node.island,
                gpus,
                node.cpu + sign * share.cpu,
                round(node.mem_gb + sign * share.mem_gb, 6),
            )
        out = NodesFree(tuple(nodes), self.size, self.packing, counts)
        out._by_name = self._by_name
        out._islands = self._islands
        return out

    def free_gpus(self, model: str) -> int:
        return sum(node.gpus.get(model, 0) for node in self.nodes)

    def fragmentation(self, model: str, demand: int) -> int:
        """Free devices of `model` on nodes that cannot hold `demand` of them: free but
        unusable for a job of that shape (the simulator's fragmentation)."""
        return sum(n for node in self.nodes if 0 < (n := node.gpus.get(model, 0)) < demand)


class _Frontiers(Mapping[str | None, tuple[tuple[int, int, float], ...]]):
    """NodesFree.frontier: per model (None: cores only), worked out when first read."""

    __slots__ = ("_known", "_nodes", "_size")

    def __init__(self, nodes: Sequence[Node], size: Mapping[str, int]) -> None:
        self._nodes = nodes
        self._size = size
        self._known: dict[str | None, tuple[tuple[int, int, float], ...]] = {}

    def __getitem__(self, model: str | None) -> tuple[tuple[int, int, float], ...]:
        known = self._known.get(model)
        if known is None:
            if model is not None and model not in self._size:
                raise KeyError(model)
            known = self._known[model] = _frontier(self._nodes, model)
        return known

    def __iter__(self) -> Iterator[str | None]:
        return iter((None, *self._size))

    def __len__(self) -> int:
        return len(self._size) + 1


def _frontier(nodes: Sequence[Node], model: str | None) -> tuple[tuple[int, int, float], ...]:
    rows = sorted(
        {
            (0 if model is None else node.gpus.get(model, 0), node.cpu, node.mem_gb)
            for node in nodes
        },
        reverse=True,
    )
    kept: list[tuple[int, int, float]] = []
    for row in rows:  # most devices first: a row is dominated only by one kept before it
        if not any(k[1] >= row[1] and k[2] >= row[2] for k in kept):
            kept.append(row)
    return tuple(kept)


def shape(
    size: Mapping[str, int], model: str | None, count: int, per_node: int | None
) -> list[int] | None:
    """The request's devices per node, largest first ([0] for a CPU-only job); None when no
    node of the site can ever hold one part (the model is not on its nodes, per_node above
    the node size)."""
    if model is None or count == 0:
        return [0]
    biggest = size.get(model, 0)
    if per_node is not None:
        if per_node > biggest:
            return None
        return [per_node] * (count // per_node)
    if biggest == 0:
        return None
    if count <= biggest:
        return [count]
    whole, rest = divmod(count, biggest)
    return [biggest] * whole + ([rest] if rest else [])


def _split(cpu: int, mem: float, devices: int, count: int) -> tuple[int, float]:
    """One node's part of the job's cores and memory: in proportion to its devices."""
    if count == 0 or devices == count:
        return cpu, mem
    return math.ceil(cpu * devices / count), mem * devices / count
