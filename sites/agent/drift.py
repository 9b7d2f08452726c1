"""What an agent's new measurement changes enough to be published again (docs/agent.md).

An agent measures every interval but writes only what moved materially since it last wrote
it, and everything at least every `agent.refresh_s` (sites.agent.process). Liveness is the lease,
not
the writes: a site is up while its agent keeps the lease alive (sites.model.snapshot.alive), so an
unchanged site costs etcd and every broker's view nothing but its keepalives. This is the
split Kubernetes made for node heartbeats (a Lease renewed often, the NodeStatus written on
change or every few minutes), for the same reason: at a thousand sites every second, the
statuses that said nothing new were most of etcd's writes and of the brokers' watch work.

Material, for a status: anything placement, routing or the operator reads as a fact (capacity,
free capacity, per-node free, devices, their busy flag and MIG layout, storage paths, mode)
changes exactly; telemetry (host CPU and memory, load, a GPU's use, power, temperature, storage
used) changes by more than a tolerance. For a link: reachability, method or emulation exactly;
the RTT or its median by more than LINK_RTT_REL of the last one written (and LINK_RTT_ABS_MS);
loss by LINK_LOSS_PCT points; the probe window holding more samples than when last written
(a window still filling is provisional: a far peer's first intervals take fewer samples, and a
reader waiting for a full window would otherwise wait for the refresh); the measured bandwidth
appearing, or moving by more than
LINK_BANDWIDTH_REL of the last written (a bulk probe's figure wobbles by several % from one
probe to the next; its time alone is not news). The tolerances compare with the value last
written, not the last measured, so a slow drift is published once it adds up.
"""

from __future__ import annotations

from sites.model.status import GpuDevice, HostUsage, LinkStatus, SiteStatus, StorageUsage

__all__ = [
    "HOST_CPU_PCT",
    "HOST_LOAD_PER_CORE",
    "HOST_MEM_REL",
    "LINK_BANDWIDTH_REL",
    "LINK_LOSS_PCT",
    "LINK_RTT_ABS_MS",
    "LINK_RTT_REL",
    "link_changed",
    "rtt_tolerance",
    "status_changed",
]

HOST_CPU_PCT = 10.0  # points of the host's CPU use
HOST_MEM_REL = 0.05  # of the host's memory
HOST_LOAD_PER_CORE = 0.25  # of the 1-minute load, per core
GPU_UTIL_PCT = 10.0  # points of a GPU's use
GPU_MEM_REL = 0.05  # of the GPU's memory
GPU_POWER_REL = 0.10  # of the last power written
GPU_TEMP_C = 5.0
STORAGE_REL = 0.01  # of the path's size
LINK_RTT_REL = 0.10  # of the last RTT written ...
LINK_RTT_ABS_MS = 1.0  # ... and at least this much
LINK_LOSS_PCT = 1.0  # points of loss
LINK_BANDWIDTH_REL = 0.20  # of the last bandwidth written


def status_changed(old: SiteStatus, new: SiteStatus) -> bool:
    """`new` says something `old` (the status last written) does not, within the tolerances."""
    if (old.site, old.instance, old.mode, old.interval_s, old.restored) != (
        new.site,
        new.instance,
        new.mode,
        new.interval_s,
        new.restored,
    ):
        return True
    if old.capacity != new.capacity or old.free != new.free or old.nodes != new.nodes:
        return True
    if _host_moved(old.host, new.host):
        return True
    if len(old.gpus) != len(new.gpus) or any(map(_gpu_moved, old.gpus, new.gpus)):
        return True
    return len(old.storage) != len(new.storage) or any(
        map(_storage_moved, old.storage, new.storage)
    )


def link_changed(old: LinkStatus, new: LinkStatus) -> bool:
    """`new` measures the path differently enough from `old` (the link last written)."""
    if (old.src, old.dst, old.method, old.emulated) != (new.src, new.dst, new.method, new.emulated):
        return True
    if _rtt_moved(old.rtt_ms, new.rtt_ms) or _rtt_moved(old.rtt_median_ms, new.rtt_median_ms):
        return True
    if _moved(
        old.bandwidth_mbps, new.bandwidth_mbps, LINK_BANDWIDTH_REL * (old.bandwidth_mbps or 0)
    ):
        return True
    if abs(old.loss_pct - new.loss_pct) >= LINK_LOSS_PCT:
        return True
    # a window still filling when it was written: its figures were provisional (a long path's
    # first intervals hold fewer samples), so each fuller window is news until it is full
    return new.samples > old.samples


def rtt_tolerance(old_ms: float | None) -> float:
    """How far an RTT may move from `old_ms`, the value last written, before it is written."""
    return max(LINK_RTT_ABS_MS, LINK_RTT_REL * (old_ms or 0.0))


def _rtt_moved(old: float | None, new: float | None) -> bool:
    return _moved(old, new, rtt_tolerance(old))


def _host_moved(old: HostUsage, new: HostUsage) -> bool:
    if old.cpu_cores != new.cpu_cores or old.mem_gb != new.mem_gb:
        return True
    if abs(old.cpu_util_pct - new.cpu_util_pct) > HOST_CPU_PCT:
        return True
    if abs(old.mem_used_gb - new.mem_used_gb) > HOST_MEM_REL * new.mem_gb:
        return True
    return abs(old.load_1m - new.load_1m) > HOST_LOAD_PER_CORE * max(1, new.cpu_cores)


def _gpu_moved(old: GpuDevice, new: GpuDevice) -> bool:
    exact = ("index", "model", "name", "uuid", "mem_gb", "busy", "mig_enabled")
    if any(getattr(old, f) != getattr(new, f) for f in exact):
        return True
    if [(m.uuid, m.profile, m.busy) for m in old.mig] != [
        (m.uuid, m.profile, m.busy) for m in new.mig
    ]:
        return True
    if abs(old.util_pct - new.util_pct) > GPU_UTIL_PCT:
        return True
    if abs(old.mem_used_gb - new.mem_used_gb) > GPU_MEM_REL * new.mem_gb:
        return True
    if _moved(old.power_w, new.power_w, GPU_POWER_REL * (old.power_w or 0.0)):
        return True
    return _moved(old.temperature_c, new.temperature_c, GPU_TEMP_C)


def _storage_moved(old: StorageUsage, new: StorageUsage) -> bool:
    if old.path != new.path or old.total_tb != new.total_tb:
        return True
    return abs(old.used_tb - new.used_tb) > STORAGE_REL * new.total_tb


def _moved(old: float | None, new: float | None, tolerance: float) -> bool:
    if old is None or new is None:
        return (old is None) != (new is None)
    return abs(new - old) > tolerance
