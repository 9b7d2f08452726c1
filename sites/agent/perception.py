"""What the agent makes of its readings (pure: the readings come in, nothing is read here): the
site's capacity and use, normalized (sites.model.capacity), and the resources its jobs may be
given (sites.agent.fit.SiteResources), in each perception mode:

- host: NVML's GPUs and this host's cores, memory and storage, measured;
- a Slurm site: the cluster's usable nodes, as scontrol reports them (sites.agent.collectors.slurm);
- declared: the site file's inventory.

What the site's own jobs hold (sites.agent.fit.held_capacity) counts as used in each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sites.agent.collectors.slurm import SlurmCapacity
from sites.agent.fit import SiteResources
from sites.model.capacity import Capacity, normalize
from sites.model.catalog import DeviceCatalog, mig_model
from sites.model.spec import Inventory, Oversubscription
from sites.model.status import GpuDevice, HostUsage, StorageUsage


def host_capacity(
    *,
    gpus: Sequence[GpuDevice],
    host: HostUsage,
    storage: Sequence[StorageUsage],
    held: Capacity,
    held_devices: Mapping[str, frozenset[int]],
    catalog: DeviceCatalog,
) -> tuple[Capacity, Capacity]:
    """(capacity, used) of a host-mode site: a GPU busy with a process or held by a job counts
    as used once; the cores the jobs hold, and the memory measured in use or the jobs'
    reservation, whichever is larger."""
    devices: dict[str, int] = {}
    busy: dict[str, int] = {}  # busy with a process or held by a job, counted once
    for gpu in gpus:
        if gpu.model is None:
            continue
        taken = gpu.busy or gpu.index in held_devices.get(gpu.model, frozenset())
        devices[gpu.model] = devices.get(gpu.model, 0) + 1
        busy[gpu.model] = busy.get(gpu.model, 0) + int(taken)
    capacity = normalize(
        devices=devices,
        cpu_cores=host.cpu_cores,
        mem_gb=host.mem_gb,
        storage_tb=sum(s.total_tb for s in storage),
        catalog=catalog,
    )
    used = normalize(
        devices=busy,
        cpu_cores=min(held.cpu_cores, host.cpu_cores),
        # measured use includes the jobs' own; their reservation is a floor
        mem_gb=max(host.mem_used_gb, held.mem_gb),
        storage_tb=sum(s.used_tb for s in storage),
        catalog=catalog,
    )
    return capacity, used


def cluster_capacity(
    slurm: SlurmCapacity, *, held: Capacity, storage_tb: float, catalog: DeviceCatalog
) -> tuple[Capacity, Capacity]:
    """(capacity, used) of a Slurm site: the cluster itself says what it has and what is
    allocated (its other users' jobs too); cpn's own runs still queued in Slurm count as used
    (the larger of the two)."""
    capacity = normalize(
        devices=slurm.devices,
        cpu_cores=slurm.cpu_cores,
        mem_gb=slurm.mem_gb,
        storage_tb=storage_tb,
        catalog=catalog,
    )
    used = normalize(
        devices={
            m: max(n - slurm.devices_free.get(m, 0), held.devices.get(m, 0))
            for m, n in slurm.devices.items()
        },
        cpu_cores=max(slurm.cpu_cores - slurm.cpu_free, held.cpu_cores),
        mem_gb=max(slurm.mem_gb - slurm.mem_free_gb, held.mem_gb),
        storage_tb=0.0,
        catalog=catalog,
    )
    return capacity, used


def declared_capacity(
    inventory: Inventory, *, held: Capacity, catalog: DeviceCatalog
) -> tuple[Capacity, Capacity]:
    """(capacity, used) of a site that declares its inventory: used is what its jobs hold."""
    capacity = normalize(
        devices={pool.model: pool.count for pool in inventory.devices},
        cpu_cores=inventory.cpu_cores,
        mem_gb=inventory.mem_gb,
        storage_tb=inventory.storage_tb,
        catalog=catalog,
    )
    return capacity, held


def host_resources(
    gpus: Sequence[GpuDevice], host: HostUsage, oversubscription: Oversubscription | None
) -> SiteResources:
    """What jobs may be given on a host-mode site: NVML's GPUs and this host's cores and memory.

    A GPU in MIG mode is its MIG instances, each a slot of its profile's pseudo-model
    (sites.model.catalog) whose id is the MIG UUID the job's CUDA_VISIBLE_DEVICES takes.
    """
    devices: dict[str, list[int]] = {}
    slots: dict[str, list[tuple[int, str]]] = {}
    for gpu in gpus:
        if gpu.model is None:
            continue
        if gpu.mig_enabled:
            for inst in gpu.mig:
                if inst.profile is not None:
                    found = slots.setdefault(mig_model(gpu.model, inst.profile), [])
                    found.append((gpu.index, inst.uuid))
            continue
        devices.setdefault(gpu.model, []).append(gpu.index)
    return SiteResources(
        devices={
            **{model: tuple(ix) for model, ix in devices.items()},
            **{model: tuple(range(len(found))) for model, found in slots.items()},
        },
        cpu_cores=host.cpu_cores,
        mem_gb=host.mem_gb,
        oversubscription=oversubscription,
        slots={model: tuple(found) for model, found in slots.items()},
    )


def cluster_resources(slurm: SlurmCapacity) -> SiteResources:
    """What jobs may be given on a Slurm site: the usable nodes' devices, cores and memory."""
    return SiteResources(
        devices={m: tuple(range(n)) for m, n in slurm.devices.items()},
        cpu_cores=slurm.cpu_cores,
        mem_gb=slurm.mem_gb,
    )
