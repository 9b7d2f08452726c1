"""GPU sharing (docs/gpu-sharing.md): a site's sharing pools as placement sees them, and where
a share of one device or a one-node request goes.

A pool declared with `sharing` (sites.model.spec.Sharing) takes any share of one device's
compute (`gpu.share`) and memory (`gpu.mem_gb`) on any of its devices with that room left;
nothing is cut in advance. Its whole free devices stay in the offer's `free_gpus` (and its
nodes'); a device with a share on it leaves them and is a *part* here, with the compute and
memory it has left (`Shared`). The broker names the device of a share by its position among
the model's devices of its node (of the site without nodes) that carry shares; the agent maps
it to a physical device (sites.agent.fit).

Choice (`choose_share`, `choose_node`): among the devices and nodes that hold the request,
the one where the expected fragmentation grows least against the site's mix of shapes
(broker.placement.fragmentation, FGD); ties to the fullest (best fit), then the node's order.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from broker.placement.fragmentation import NodeState, Scorer, cpu_key
from broker.placement.nodes import Chosen, NodesFree
from sites.model.assignments import DeviceShare, NodeShare

__all__ = [
    "NodeKey",
    "Part",
    "ShareKey",
    "Shared",
    "choose_node",
    "choose_share",
    "score_node",
    "score_share",
    "share_mem_gb",
]

_EPS = 1e-9
Part = tuple[float, float]  # what a partly used device has left: (compute share, memory GB)
_NO_PARTS: Mapping[int, Part] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Shared:
    """A site's sharing pools: per model its mode and per-device memory, and the devices with
    shares on them, per (node, model) (node None at a site without nodes): device -> Part.
    `best`: per model, the parts no other part has as much of in both (the screen's test)."""

    modes: Mapping[str, str]
    device_mem_gb: Mapping[str, float]
    parts: Mapping[tuple[str | None, str], Mapping[int, Part]]
    best: Mapping[str, tuple[Part, ...]]
    busy: frozenset[str | None] = frozenset()  # the nodes with shares on a device

    @classmethod
    def of(
        cls,
        modes: Mapping[str, str],
        device_mem_gb: Mapping[str, float],
        held: Iterable[tuple[str | None, str, int, float, float]] = (),
    ) -> Shared:
        """The pools with `held` shares on them: (node, model, device, share, GB) each."""
        parts: dict[tuple[str | None, str], dict[int, Part]] = {}
        for node, model, device, share, mem in held:
            if model not in modes:
                continue
            on = parts.setdefault((node, model), {})
            c, g = on.get(device, (1.0, device_mem_gb.get(model, 0.0)))
            on[device] = (round(c - share, 9), round(g - mem, 6))
        return cls(modes, device_mem_gb, parts, _frontiers(parts), frozenset(n for n, _ in parts))

    def holds(self, model: str, share: float, mem_gb: float) -> bool:
        """Has a partly used device of `model` the room (whole free devices: the offer's)."""
        return any(c >= share - _EPS and g >= mem_gb - _EPS for c, g in self.best.get(model, ()))

    def on(self, node: str | None, model: str) -> Mapping[int, Part]:
        return self.parts.get((node, model), _NO_PARTS)

    def devices_in_part(self, model: str) -> int:
        """Devices of `model` with shares on them (held, as whole devices are)."""
        return sum(len(p) for (_, m), p in self.parts.items() if m == model)

    def with_share(
        self, node: str | None, model: str, device: int, share: float, mem_gb: float, sign: int
    ) -> tuple[Shared, int]:
        """The pools after a share is taken (sign=-1) or given back (sign=1), and how many
        whole devices that moves: -1 when a whole device became a part, +1 when a part
        became whole again, else 0."""
        on = dict(self.on(node, model))
        full = self.device_mem_gb.get(model, 0.0)
        c, g = on.get(device, (1.0, full))
        c, g = round(c + sign * share, 9), round(g + sign * mem_gb, 6)
        moved = 0
        if device not in on:
            moved = -1
        if c >= 1.0 - _EPS and g >= full - _EPS:
            del_ok = device in on
            on.pop(device, None)
            moved = 1 if del_ok else 0
        else:
            on[device] = (c, g)
        parts = dict(self.parts)
        if on:
            parts[(node, model)] = MappingProxyType(on)
        else:
            parts.pop((node, model), None)
        best = dict(self.best)
        best[model] = _frontier(
            p for (_, m), ps in parts.items() if m == model for p in ps.values()
        )
        busy = self.busy | {node} if on else frozenset(n for n, _ in parts)
        return Shared(self.modes, self.device_mem_gb, parts, best, busy), moved


def share_mem_gb(share: float, mem_gb: float | None, device_mem_gb: float) -> float:
    """The device memory a share holds: what it asks, else its share of the device's."""
    return mem_gb if mem_gb is not None else round(share * device_mem_gb, 6)


def choose_share(
    shared: Shared,
    nodes: NodesFree | None,
    site_whole: int,
    site_cpu: int,
    site_mem_gb: float,
    model: str,
    share: float,
    mem_gb: float,
    cpu: int,
    host_mem_gb: float,
    scorer: Scorer,
) -> DeviceShare | None:
    """The device for a share (module docstring): a partly used one with the room, or a whole
    free one; None when none holds it (with the node's cores and memory)."""
    found = score_share(
        shared, nodes, site_whole, site_cpu, site_mem_gb, model, share, mem_gb, cpu,
        host_mem_gb, scorer,
    )  # fmt: skip
    return None if found is None else found[1]


ShareKey = tuple[float, float, int, int, int]  # (growth, room left, whole left, node, device)
NodeKey = tuple[float, float, float, int]  # (growth, tie-break, cores left, node)


def score_share(
    shared: Shared,
    nodes: NodesFree | None,
    site_whole: int,
    site_cpu: int,
    site_mem_gb: float,
    model: str,
    share: float,
    mem_gb: float,
    cpu: int,
    host_mem_gb: float,
    scorer: Scorer,
) -> tuple[ShareKey, DeviceShare] | None:
    """choose_share's device with its key (lower is better; keys of one site's models
    compare: the growth is in devices against one mix)."""
    full_mem = shared.device_mem_gb.get(model, 0.0)
    if mem_gb > full_mem + _EPS or share > 1.0 + _EPS:
        return None
    rows: Iterable[tuple[str | None, int, int, float]]  # (node, whole free, cores, GB)
    if nodes is None:
        rows = ((None, site_whole, site_cpu, site_mem_gb),)
    else:
        rows = ((n.name, n.gpus.get(model, -1), n.cpu, n.mem_gb) for n in nodes.nodes)
    busy = shared.busy
    known: dict[tuple[int, int, float], float] = {}  # alike nodes without shares: scored once
    best: tuple[tuple[float, float, int, int, int], str | None, int] | None = None
    for order, (name, whole, node_cpu, node_mem) in enumerate(rows):
        if whole < 0 or node_cpu < cpu or node_mem < host_mem_gb - _EPS:
            continue  # not a node of the model, or without the cores or memory
        left_cpu, left_mem = node_cpu - cpu, round(node_mem - host_mem_gb, 6)
        new_part = (round(1.0 - share, 9),) if share < 1.0 - _EPS else ()
        if name not in busy:
            if whole < 1:
                continue
            alike = (whole, node_cpu, node_mem)
            delta = known.get(alike)
            if delta is None:
                before = NodeState(whole, (), node_cpu, node_mem)
                delta = known[alike] = scorer.delta(
                    before, NodeState(whole - 1, new_part, left_cpu, left_mem)
                )
            key = (delta, 2.0 - share, whole - 1, order, 0)
            if best is None or key < best[0]:
                best = (key, name, 0)
            continue
        on = shared.on(name, model)
        parts = tuple(sorted((c for c, _ in on.values()), reverse=True))
        before = NodeState(whole, parts, node_cpu, node_mem)
        seen: set[Part] = set()
        for device, (c, g) in sorted(on.items()):
            if c < share - _EPS or g < mem_gb - _EPS or (c, g) in seen:
                continue
            seen.add((c, g))
            after_parts = list(parts)
            after_parts.remove(c)
            if c - share > _EPS:
                after_parts.append(round(c - share, 9))
            after = NodeState(whole, tuple(sorted(after_parts, reverse=True)), left_cpu, left_mem)
            key = (scorer.delta(before, after), c - share, whole, order, device)
            if best is None or key < best[0]:
                best = (key, name, device)
        if whole >= 1:
            after = NodeState(
                whole - 1, tuple(sorted((*parts, *new_part), reverse=True)), left_cpu, left_mem
            )
            device = next(i for i in range(len(on) + 1) if i not in on)
            key = (scorer.delta(before, after), 2.0 - share, whole - 1, order, device)
            if best is None or key < best[0]:
                best = (key, name, device)
    if best is None:
        return None
    key, name, device = best
    return key, DeviceShare(
        device=device, node=name, share=share, mem_gb=mem_gb, mode=shared.modes[model]
    )


def choose_node(
    nodes: NodesFree,
    shared: Shared | None,
    model: str | None,
    count: int,
    cpu: int,
    mem_gb: float,
    scorer: Scorer,
) -> Chosen | None:
    """score_node's choice without its key."""
    found = score_node(nodes, shared, model, count, cpu, mem_gb, scorer)
    return None if found is None else found[1]


def score_node(
    nodes: NodesFree,
    shared: Shared | None,
    model: str | None,
    count: int,
    cpu: int,
    mem_gb: float,
    scorer: Scorer,
) -> tuple[NodeKey, Chosen] | None:
    """One node for a request of `count` whole devices of `model` (0 / None: CPU-only) where
    the expected fragmentation grows least; ties: CPU-only work to the node with the fewest
    free accelerators, other work to the fullest node (best fit). None: no node holds it.
    Nodes alike (the same free devices, cores and memory, no shares) are scored once."""
    busy = shared.busy if shared is not None else frozenset()
    known: dict[tuple[int, float, tuple[tuple[str, int], ...]], tuple[float, float]] = {}
    best: tuple[tuple[float, float, float, int], int] | None = None
    for i, node in enumerate(nodes.nodes):
        node_cpu, node_mem = node.cpu, node.mem_gb
        if node_cpu < cpu or node_mem < mem_gb - _EPS:
            continue
        gpus = node.gpus
        have = gpus.get(model, 0) if model is not None else 0
        if have < count:
            continue
        alike = None if node.name in busy else (node_cpu, node_mem, tuple(gpus.items()))
        scored = None if alike is None else known.get(alike)
        if scored is None:
            delta = devices = 0.0
            for m, whole in gpus.items():
                on = _NO_PARTS if shared is None or alike is not None else shared.on(node.name, m)
                parts = tuple(sorted((c for c, _ in on.values()), reverse=True))
                before = NodeState(whole, parts, node_cpu, node_mem)
                taken = count if m == model else 0
                after = NodeState(whole - taken, parts, node_cpu - cpu, round(node_mem - mem_gb, 6))
                delta += scorer.delta(before, after)
                devices += before.free
            scored = (delta, devices)
            if alike is not None:
                known[alike] = scored
        delta, devices = scored
        tie = cpu_key(devices) if not count else float(have)
        key = (delta, tie, float(node_cpu - cpu), i)
        if best is None or key < best[0]:
            best = (key, i)
    if best is None:
        return None
    node = nodes.nodes[best[1]]
    gpus_taken = count if model is not None else 0
    part = NodeShare(node=node.name, gpus=gpus_taken, cpu=cpu, mem_gb=mem_gb)
    return best[0], Chosen((part,), node.island, False)


def _frontiers(
    parts: Mapping[tuple[str | None, str], Mapping[int, Part]],
) -> dict[str, tuple[Part, ...]]:
    by_model: dict[str, list[Part]] = {}
    for (_, model), on in parts.items():
        by_model.setdefault(model, []).extend(on.values())
    return {model: _frontier(found) for model, found in by_model.items()}


def _frontier(found: Iterable[Part]) -> tuple[Part, ...]:
    kept: list[Part] = []
    for c, g in sorted(set(found), reverse=True):  # most compute first
        if not any(kg >= g for _, kg in kept):
            kept.append((c, g))
    return tuple(kept)
