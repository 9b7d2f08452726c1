"""CPU, memory and storage of the host the agent runs on (psutil)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import psutil

from sites.model.status import HostUsage, StorageUsage

log = logging.getLogger(__name__)

GB = 1024**3
TB = 1000**4


def host_usage() -> HostUsage:
    mem = psutil.virtual_memory()
    return HostUsage(
        cpu_cores=psutil.cpu_count(logical=True) or 1,
        # interval=None: utilisation since the previous call, never blocks the loop
        cpu_util_pct=psutil.cpu_percent(interval=None),
        mem_gb=round(mem.total / GB, 3),
        mem_used_gb=round((mem.total - mem.available) / GB, 3),
        load_1m=os.getloadavg()[0],
    )


def storage_usage(paths: Iterable[str]) -> list[StorageUsage]:
    """Usage of each configured path; a missing path is logged and skipped, not fatal."""
    out = []
    for path in paths:
        try:
            du = psutil.disk_usage(path)
        except OSError as exc:
            log.warning("storage path %s: %s", path, exc.strerror or exc)
            continue
        out.append(StorageUsage(path=path, total_tb=du.total / TB, used_tb=du.used / TB))
    return out
