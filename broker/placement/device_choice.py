"""Where at a chosen site a share of one device goes (broker.placement.sharing on an offer),
and how a site's node choice scores (its mix of shapes, broker.placement.fragmentation): the
fast path's, the batch pass's commit and the simulator's. Pure: no I/O.
"""

from __future__ import annotations

from broker.model.jobs import JobSpec
from broker.placement.fragmentation import NO_MIX, Scorer
from broker.placement.offers import PlacementError
from broker.placement.sharing import choose_share, share_mem_gb
from broker.placement.site import SiteOffer
from sites.model.assignments import DeviceShare, NodeShare

__all__ = ["scorer_of", "share_at", "share_nodes"]


def scorer_of(site: SiteOffer) -> Scorer:
    """The site's node scores against the shapes it holds (broker.placement.fragmentation)."""
    return (site.mix or NO_MIX).scorer()


def share_at(job: JobSpec, site: SiteOffer, model: str | None) -> DeviceShare | None:
    """The device for a job's share of one at `site` (broker.placement.sharing): None when
    the job asks no share or `model` is not a sharing pool's (a time slice cut in the site
    file); PlacementError when no device has the room (a caller's stale snapshot)."""
    gpu = job.gpu
    shared = site.shared
    if gpu.share is None or model is None or shared is None or model not in shared.modes:
        return None
    scorer = scorer_of(site)
    mem = share_mem_gb(gpu.share, gpu.mem_gb, site.gpu_mem_gb.get(model, 0.0))
    found = choose_share(
        shared, site.nodes, site.free_gpus.get(model, 0), site.free_cpu, site.free_mem_gb,
        model, gpu.share, mem, job.cpu, job.mem_gb, scorer,
    )  # fmt: skip
    if found is None:
        raise PlacementError(f"{site.id}: no {model} device has room for {job.name}'s share")
    return found


def share_nodes(
    job: JobSpec, device: DeviceShare, model: str | None
) -> tuple[tuple[NodeShare, ...], str | None, str]:
    """A share's node part (its cores and memory; its device is in the share) and words."""
    what = f"; {device.share:g} of {model} device {device.device} ({device.mode}"
    what += f", {device.mem_gb:g} GB)"
    if device.node is None:
        return (), None, what
    node = NodeShare(node=device.node, gpus=0, cpu=job.cpu, mem_gb=job.mem_gb)
    return (node,), None, f"{what} on node {device.node}"
