"""Where each device slot of a declared site is: its physical device and its node. Pure.

A site's devices, as placement and the agent see them, are slots of (pseudo-)models
(sites.model.catalog: a whole device, a MIG instance "A100-80GB/3g.40gb", a time slice "H100/ts4").
The agent hands a run slot positions (Run.devices, 0..n-1 per model); this module says which
physical device each position is (the executor's CUDA_VISIBLE_DEVICES), its slot id (a MIG
instance or a time slice of that device), and, at a site that declares its nodes, which
node holds it: nodes own the physical devices of each model in declaration order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sites.model.catalog import DeviceCatalog, device_slots
from sites.model.spec import SiteSpec

__all__ = ["Layout", "layout"]


@dataclass(frozen=True)
class Layout:
    # (pseudo-)model -> per slot position: (physical device index within its model, slot id;
    # "" for a whole device)
    slots: dict[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    # node -> (pseudo-)model -> the slot positions on it ({} without declared nodes)
    nodes: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)


def layout(spec: SiteSpec, catalog: DeviceCatalog | None = None) -> Layout:
    """The site's slots and, with declared nodes, each node's. Without a catalog (or without
    partitions) every device is one slot at its own index."""
    slots: dict[str, tuple[tuple[int, str], ...]] = {}
    base_of: dict[str, str] = {}
    for pool in spec.inventory.devices:
        if pool.partitions and catalog is not None:
            for model, found in device_slots(pool, catalog).items():
                slots[model] = found
                base_of[model] = pool.model
        else:
            slots[pool.model] = tuple((i, "") for i in range(pool.count))
            base_of[pool.model] = pool.model
    nodes: dict[str, dict[str, tuple[int, ...]]] = {}
    topology = spec.topology
    if topology is not None:
        owner: dict[tuple[str, int], str] = {}  # (model, physical index) -> node
        next_index: dict[str, int] = {}
        for group in topology.nodes:
            for name in group.node_names():
                nodes[name] = {}
                for model, n in group.devices.items():
                    first = next_index.get(model, 0)
                    for i in range(first, first + n):
                        owner[(model, i)] = name
                    next_index[model] = first + n
        for model, found in slots.items():
            base = base_of[model]
            mine: dict[str, list[int]] = {}
            for position, (index, _) in enumerate(found):
                node = owner.get((base, index))
                if node is not None:
                    mine.setdefault(node, []).append(position)
            for node, positions in mine.items():
                nodes[node][model] = tuple(positions)
    return Layout(slots, nodes)
