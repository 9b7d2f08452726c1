"""GPUs through NVML (nvidia-ml-py). No driver or no GPU means zero GPUs and one log line."""

from __future__ import annotations

import logging
from typing import Any

from sites.catalog import DeviceCatalog
from sites.status import GpuDevice

log = logging.getLogger(__name__)

GB = 1024**3


class NvmlCollector:
    def __init__(self, *, catalog: DeviceCatalog) -> None:
        self._catalog = catalog
        self._nvml: Any = None
        self._reason = ""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - any NVML failure means "no GPUs here"
            self._reason = f"{type(exc).__name__}: {exc}"
            log.info("NVML unavailable (%s): reporting zero GPUs", self._reason)
        else:
            self._nvml = pynvml

    @property
    def available(self) -> bool:
        return self._nvml is not None

    @property
    def reason(self) -> str:
        return self._reason

    def collect(self) -> list[GpuDevice]:
        nv = self._nvml
        if nv is None:
            return []
        try:
            return [self._device(nv, i) for i in range(nv.nvmlDeviceGetCount())]
        except nv.NVMLError as exc:
            log.warning("NVML query failed: %s; reporting zero GPUs this round", exc)
            return []

    def _device(self, nv: Any, index: int) -> GpuDevice:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        name = nv.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        util = nv.nvmlDeviceGetUtilizationRates(handle)
        uuid = nv.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        power = _optional(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0, nv)
        temp = _optional(lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU), nv)
        procs = _optional(lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle), nv) or []
        return GpuDevice(
            index=index,
            model=self._catalog.match_nvml(name),
            name=name,
            uuid=uuid,
            mem_gb=round(mem.total / GB, 2),
            mem_used_gb=round(mem.used / GB, 2),
            util_pct=float(util.gpu),
            power_w=power,
            temperature_c=None if temp is None else float(temp),
            busy=len(procs) > 0,
        )

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)
            self._nvml = None


def _optional(fn: Any, nv: Any) -> Any:
    """Some queries are unsupported on some boards (NVML_ERROR_NOT_SUPPORTED): None then."""
    try:
        return fn()
    except nv.NVMLError:
        return None
