"""Resource fit: what devices, cores and memory a job gets at this site (`allocate`, pure), what
the executor is told of slices (`sliced`), and what the live runs hold (`held_capacity`,
`held_devices`, `node_usage`: what the agent publishes as used and free).

The workload (sites.agent.workload) asks `allocate` before it starts a run; the broker's
placement should have kept an assignment within what is free, so DoesNotFit here means the
two disagree (the run is reported failed, or waits for stopping runs to free their share).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sites.agent.runs import Run
from sites.model.assignments import Assignment
from sites.model.capacity import Capacity, normalize
from sites.model.catalog import DeviceCatalog
from sites.model.errors import SitesError
from sites.model.layout import layout
from sites.model.spec import Oversubscription, SiteSpec, Topology
from sites.model.status import NodeUsage


class DoesNotFit(SitesError):
    """An assignment asks for more than the site has free (the broker should have prevented it)."""


@dataclass(frozen=True)
class SiteResources:
    """What jobs can be given: device indices per model, cores and RAM."""

    devices: Mapping[str, tuple[int, ...]]
    cpu_cores: int
    mem_gb: float
    # the site's best-effort capacity above the physical (sites.model.spec.Oversubscription):
    # best-effort runs share devices, cores and memory up to it; others never exceed the
    # physical, whatever best-effort work holds
    oversubscription: Oversubscription | None = None
    # a site that declares its nodes (sites.model.spec.Topology): node -> model -> its device
    # indices
    nodes: Mapping[str, Mapping[str, tuple[int, ...]]] = field(default_factory=dict)
    # a partitioned device's slices (sites.model.layout): model -> per index, (physical device, slot
    # id); absent for whole devices, whose index is the device's
    slots: Mapping[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)


def declared_resources(spec: SiteSpec, catalog: DeviceCatalog | None = None) -> SiteResources:
    """The declared inventory as slots (sites.model.layout): positions 0..n-1 per (pseudo-)model, a
    partitioned device's slices (with the catalog) under their own names, given to the
    declared nodes in order (the first node has the lowest indices)."""
    inv = spec.inventory
    where = layout(spec, catalog)
    return SiteResources(
        devices={model: tuple(range(len(found))) for model, found in where.slots.items()},
        cpu_cores=inv.cpu_cores,
        mem_gb=inv.mem_gb,
        oversubscription=spec.oversubscription,
        nodes=where.nodes,
        slots=where.slots,
    )


def allocate(
    assignment: Assignment, resources: SiteResources, held: Iterable[Run]
) -> tuple[int, ...]:
    """Device indices for ``assignment`` next to the live runs ``held`` (pure); DoesNotFit.

    On an oversubscribed site (resources.oversubscription) a best-effort run may share a
    device with other runs, at most ceil(ratio) runs a device, least shared first, and the
    cores and memory up to the physical x ratio; any other run counts only what other
    non-best-effort runs hold against the physical. Elsewhere every run holds what it takes."""
    live = [run for run in held if run.live]
    a = assignment
    over = resources.oversubscription
    if over is not None and a.best_effort:
        return _share(a, resources, over, live)
    # the runs whose holdings count against this one: all of them, or on an oversubscribed
    # site the non-best-effort ones (best-effort work lives above the physical)
    holding = live if over is None else [run for run in live if not run.assignment.best_effort]
    devices: tuple[int, ...] = ()
    if a.share is not None:
        devices = _shared_device(a, resources, holding)
    elif a.gpus > 0:
        if a.model is None:
            raise DoesNotFit(f"asks for {a.gpus} accelerator(s) but names no model")
        pool = resources.devices.get(a.model, ())
        if not pool:
            have = ", ".join(f"{len(ix)} x {m}" for m, ix in resources.devices.items()) or "none"
            raise DoesNotFit(f"site has no {a.model} devices (it has: {have})")
        taken = {i for run in holding if run.assignment.model == a.model for i in run.devices}
        if a.nodes and resources.nodes:
            devices = _on_nodes(a, a.model, resources, taken)
        else:
            free = [i for i in pool if i not in taken]
            if len(free) < a.gpus:
                raise DoesNotFit(
                    f"needs {a.gpus} x {a.model}, only {len(free)} of {len(pool)} free"
                )
            devices = tuple(free[: a.gpus])
    cpu_free = resources.cpu_cores - sum(run.assignment.cpu for run in holding)
    if a.cpu > cpu_free:
        raise DoesNotFit(f"needs {a.cpu} CPU cores, only {max(0, cpu_free)} free")
    mem_free = resources.mem_gb - sum(run.assignment.mem_gb for run in holding)
    if a.mem_gb > mem_free + 1e-9:
        raise DoesNotFit(f"needs {a.mem_gb:g} GB of memory, only {max(0.0, mem_free):g} free")
    return devices


def _shared_device(a: Assignment, resources: SiteResources, holding: Sequence[Run]) -> tuple[int]:
    """The device of a share (Assignment.share): the broker names it by its position among
    the devices with shares of its node (of the site); the device the live shares at that
    position run on, else a device of the model that no run holds."""
    share, model = a.share, a.model
    if share is None or model is None:
        raise DoesNotFit("a share names no device model")
    if share.node is not None and resources.nodes:
        node = resources.nodes.get(share.node)
        if node is None:
            raise DoesNotFit(f"the broker chose node {share.node!r}, which this site lacks")
        pool = node.get(model, ())
    else:
        pool = resources.devices.get(model, ())
    if not pool:
        raise DoesNotFit(f"site has no {model} devices to share")
    mine = [
        run
        for run in holding
        if run.assignment.model == model
        and (other := run.assignment.share) is not None
        and (other.node, other.device) == (share.node, share.device)
        and run.devices
    ]
    if mine:
        used = sum(run.assignment.share.share for run in mine if run.assignment.share)
        if used + share.share > 1.0 + 1e-9:
            raise DoesNotFit(
                f"device {share.device} of {model} has {max(0.0, 1.0 - used):.2f} of its "
                f"compute left, the share asks {share.share:g}"
            )
        return (mine[0].devices[0],)
    taken = {i for run in holding if run.assignment.model == model for i in run.devices}
    free = [i for i in pool if i not in taken]
    if not free:
        raise DoesNotFit(f"no {model} device is free for a new shared device")
    return (free[-1],)  # from the top: whole-device runs take from the bottom


def share_env(a: Assignment) -> dict[str, str]:
    """What a run on a share of a device is told (over its own env: what cpn sets wins):
    CPN_GPU_SHARE, CPN_GPU_MEM_GB and CPN_GPU_SHARING always; on an MPS pool the limits MPS
    clients honour, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the compute share, in percent) and
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (the memory, on the one device the run sees: ordinal
    0). Time slicing limits neither (docs/gpu-sharing.md)."""
    share = a.share
    if share is None:
        return {}
    env = {
        "CPN_GPU_SHARE": f"{share.share:.4g}",
        "CPN_GPU_MEM_GB": f"{share.mem_gb:.6g}",
        "CPN_GPU_SHARING": share.mode,
    }
    if share.mode == "mps":
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(share.share * 100)))
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, int(share.mem_gb * 1024))}M"
    return env


def sliced(
    a: Assignment, devices: tuple[int, ...], resources: SiteResources, catalog: DeviceCatalog
) -> tuple[Assignment, tuple[int, ...]]:
    """What the executor is given for a run on slices of devices (sites.model.layout): the physical
    devices they are on (the visibility variable lists those) and the slices themselves in
    CPN_GPU_SLICES (MIG instance or time-slice ids) and CPN_GPU_SHARE (the share of a device
    each is); a run on whole devices, the physical indices of its positions (a partitioned
    pool's whole devices come after its partitioned ones); a run on a share of a sharing
    pool's device (Assignment.share), that device and its limits (`share_env`)."""
    if a.share is not None:
        return a.model_copy(update={"env": {**a.env, **share_env(a)}}), devices
    found = resources.slots.get(a.model or "")
    if not devices or found is None:
        return a, devices
    physical = tuple(sorted({found[i][0] for i in devices}))
    if all(not found[i][1] for i in devices):  # whole devices: their own indices
        return a, physical
    env = {
        **a.env,
        "CPN_GPU_SLICES": ",".join(found[i][1] for i in devices),
        "CPN_GPU_SHARE": f"{catalog.fraction(a.model or ''):.4g}",
    }
    return a.model_copy(update={"env": env}), physical


def _on_nodes(
    a: Assignment, model: str, resources: SiteResources, taken: set[int]
) -> tuple[int, ...]:
    """The devices of the nodes the broker chose (Assignment.nodes), share by share."""
    devices: list[int] = []
    for share in a.nodes:
        node = resources.nodes.get(share.node)
        if node is None:
            raise DoesNotFit(f"the broker chose node {share.node!r}, which this site lacks")
        free = [i for i in node.get(model, ()) if i not in taken]
        if len(free) < share.gpus:
            raise DoesNotFit(
                f"needs {share.gpus} x {model} on node {share.node}, only {len(free)} free there"
            )
        devices.extend(free[: share.gpus])
    if len(devices) != a.gpus:
        raise DoesNotFit(f"its nodes hold {len(devices)} of the {a.gpus} x {model} it asks for")
    return tuple(devices)


def _share(
    a: Assignment, resources: SiteResources, over: Oversubscription, live: Sequence[Run]
) -> tuple[int, ...]:
    """A best-effort run's devices, cores and memory on an oversubscribed site (allocate)."""
    devices: tuple[int, ...] = ()
    if a.share is not None:
        devices = _shared_device(a, resources, live)
    elif a.gpus > 0:
        if a.model is None:
            raise DoesNotFit(f"asks for {a.gpus} accelerator(s) but names no model")
        pool = resources.devices.get(a.model, ())
        per_device = math.ceil(over.gpu_ratio(a.model))
        holders = dict.fromkeys(pool, 0)
        for run in live:
            if run.assignment.model == a.model:
                for i in run.devices:
                    if i in holders:
                        holders[i] += 1
        open_ = sorted((n, i) for i, n in holders.items() if n < per_device)
        if len(open_) < a.gpus:
            raise DoesNotFit(
                f"needs {a.gpus} x {a.model}, only {len(open_)} of {len(pool)} may take "
                f"another best-effort run ({per_device} a device)"
            )
        devices = tuple(sorted(i for _, i in open_[: a.gpus]))
    cpu_free = int(resources.cpu_cores * over.cpu) - sum(run.assignment.cpu for run in live)
    if a.cpu > cpu_free:
        raise DoesNotFit(f"needs {a.cpu} CPU cores, only {max(0, cpu_free)} free")
    mem_free = resources.mem_gb * over.mem_gb - sum(run.assignment.mem_gb for run in live)
    if a.mem_gb > mem_free + 1e-9:
        raise DoesNotFit(f"needs {a.mem_gb:g} GB of memory, only {max(0.0, mem_free):g} free")
    return devices


def held_devices(runs: Iterable[Run]) -> dict[str, frozenset[int]]:
    """The device indices the live runs hold, per model."""
    held: dict[str, set[int]] = {}
    for run in runs:
        if run.live and run.devices and run.assignment.model is not None:
            held.setdefault(run.assignment.model, set()).update(run.devices)
    return {model: frozenset(ix) for model, ix in held.items()}


def held_capacity(runs: Iterable[Run], catalog: DeviceCatalog) -> Capacity:
    """Capacity held by the live runs: their devices per model, cores and memory."""
    live = [run for run in runs if run.live]
    return normalize(
        devices={model: len(ix) for model, ix in held_devices(live).items()},
        cpu_cores=sum(run.assignment.cpu for run in live),
        mem_gb=sum(run.assignment.mem_gb for run in live),
        storage_tb=0.0,
        catalog=catalog,
    )


def node_usage(
    runs: Iterable[Run],
    nodes: Mapping[str, Mapping[str, tuple[int, ...]]],
    topology: Topology | None,
) -> tuple[NodeUsage, ...]:
    """What each of `nodes` (SiteResources.nodes) has free next to the live runs; () without
    nodes."""
    if not nodes:
        return ()
    live = [run for run in runs if run.live]
    held = held_devices(live)
    cores: dict[str, int] = {}
    mem: dict[str, float] = {}
    for run in live:
        for share in run.assignment.nodes:
            cores[share.node] = cores.get(share.node, 0) + share.cpu
            mem[share.node] = mem.get(share.node, 0.0) + share.mem_gb
    sizes: dict[str, tuple[int, float, str | None]] = {}
    if topology is not None:
        for group in topology.nodes:
            for i, name in enumerate(group.node_names()):
                sizes[name] = (group.cpu_cores, group.mem_gb, group.island_of(i))
    out = []
    for name, devices in nodes.items():
        cpu, gb, island = sizes.get(name, (0, 0.0, None))
        free = {m: len(set(ix) - held.get(m, frozenset())) for m, ix in devices.items()}
        out.append(
            NodeUsage(
                node=name,
                island=island,
                free_devices=free,
                free_cpu=max(0, cpu - cores.get(name, 0)),
                free_mem_gb=round(max(0.0, gb - mem.get(name, 0.0)), 6),
            )
        )
    return tuple(out)
