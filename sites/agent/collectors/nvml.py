"""GPUs through NVML (nvidia-ml-py). No driver or no GPU means zero GPUs and one log line.

A GPU in MIG mode also reports its MIG devices (GpuDevice.mig): UUID, memory, busy, and the
GPU-instance profile mapped to the catalog's profile name (docs/catalog.md). The profile is
read from the GPU instance's profile id (nvmlDeviceGetGpuInstanceById, nvmlGpuInstanceGetInfo,
nvmlDeviceGetGpuInstanceProfileInfoById) and, where those need privileges the agent lacks,
from the MIG device's name ("NVIDIA A100-SXM4-80GB MIG 3g.40gb"). A query a board does not
support yields a missing figure, never a missing GPU.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any

from sites.model.catalog import DeviceCatalog
from sites.model.status import GpuDevice, MigInstance

log = logging.getLogger(__name__)

GB = 1024**3
# "3g.40gb", "1g.10gb+me", or a compute-instance slice of a GPU instance, "1c.3g.40gb" (1 of
# its 3 compute slices: not a whole catalog profile)
_PROFILE_RE = re.compile(r"(?:(\d+)c\.)?(\d+)g\.(\d+gb(?:\+me)?)")


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
        name = _text(nv.nvmlDeviceGetName(handle))
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        uuid = _text(nv.nvmlDeviceGetUUID(handle))
        # in MIG mode the parent GPU answers NOT_SUPPORTED to utilization: 0, not an error
        util = _optional(lambda: nv.nvmlDeviceGetUtilizationRates(handle), nv)
        power = _optional(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0, nv)
        temp = _optional(lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU), nv)
        procs = _optional(lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle), nv) or []
        model = self._catalog.match_nvml(name)
        mig_enabled = _mig_enabled(nv, handle)
        instances = self._mig_instances(nv, handle, model) if mig_enabled else ()
        return GpuDevice(
            index=index,
            model=model,
            name=name,
            uuid=uuid,
            mem_gb=round(mem.total / GB, 2),
            mem_used_gb=round(mem.used / GB, 2),
            util_pct=float(util.gpu) if util is not None else 0.0,
            power_w=power,
            temperature_c=None if temp is None else float(temp),
            busy=len(procs) > 0 or any(i.busy for i in instances),
            mig_enabled=mig_enabled,
            mig=instances,
        )

    def _mig_instances(self, nv: Any, handle: Any, model: str | None) -> tuple[MigInstance, ...]:
        count = _optional(lambda: nv.nvmlDeviceGetMaxMigDeviceCount(handle), nv) or 0
        found: list[MigInstance] = []
        for slot in range(int(count)):
            mig = _optional(
                functools.partial(nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot), nv
            )
            if mig is None:  # NVML_ERROR_NOT_FOUND: an empty slot
                continue
            found.append(self._mig_instance(nv, handle, mig, model))
        return tuple(found)

    def _mig_instance(self, nv: Any, parent: Any, mig: Any, model: str | None) -> MigInstance:
        mem = _optional(lambda: nv.nvmlDeviceGetMemoryInfo(mig), nv)
        gi = _optional(lambda: nv.nvmlDeviceGetGpuInstanceId(mig), nv)
        ci = _optional(lambda: nv.nvmlDeviceGetComputeInstanceId(mig), nv)
        procs = _optional(lambda: nv.nvmlDeviceGetComputeRunningProcesses(mig), nv) or []
        # the name first: it also tells a compute-instance slice ("1c.3g.40gb") apart
        nvml_profile = _profile_from_name(nv, mig) or _profile_by_id(nv, parent, gi)
        return MigInstance(
            uuid=_text(nv.nvmlDeviceGetUUID(mig)),
            profile=self._catalog_profile(model, nvml_profile),
            nvml_profile=nvml_profile,
            mem_gb=round(mem.total / GB, 2) if mem is not None else 0.0,
            mem_used_gb=round(mem.used / GB, 2) if mem is not None else 0.0,
            gpu_instance_id=None if gi is None else int(gi),
            compute_instance_id=None if ci is None else int(ci),
            busy=len(procs) > 0,
        )

    def _catalog_profile(self, model: str | None, nvml_profile: str) -> str | None:
        """The catalog profile of a whole GPU instance; None for a slice of one (its compute
        instance has fewer compute slices), a profile the catalog lacks or an unknown GPU."""
        match = _PROFILE_RE.fullmatch(nvml_profile)
        if model is None or match is None:
            return None
        ci_slices, gi_slices, memory = match.groups()
        if ci_slices is not None and ci_slices != gi_slices:
            return None
        profile = f"{gi_slices}g.{memory}"
        mig = self._catalog.get(model).mig
        return profile if mig is not None and profile in mig.profiles else None

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)
            self._nvml = None


def _mig_enabled(nv: Any, handle: Any) -> bool:
    """Current MIG mode; a GPU without MIG support (NOT_SUPPORTED) is not in MIG mode."""
    modes = _optional(lambda: nv.nvmlDeviceGetMigMode(handle), nv)
    enable = getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)
    return modes is not None and int(modes[0]) == enable


def _profile_by_id(nv: Any, parent: Any, gpu_instance_id: int | None) -> str:
    """The GPU instance's profile name ("3g.40gb") from its profile id, or "" when NVML will
    not say (these calls need a privileged user on some drivers)."""
    if gpu_instance_id is None:
        return ""
    instance = _optional(lambda: nv.nvmlDeviceGetGpuInstanceById(parent, gpu_instance_id), nv)
    info = None if instance is None else _optional(lambda: nv.nvmlGpuInstanceGetInfo(instance), nv)
    if info is None:
        return ""
    profile = _optional(
        lambda: nv.nvmlDeviceGetGpuInstanceProfileInfoById(parent, info.profileId), nv
    )
    if profile is None:
        return ""
    return _profile_name(_text(profile.name))


def _profile_from_name(nv: Any, mig: Any) -> str:
    name = _optional(lambda: nv.nvmlDeviceGetName(mig), nv)
    return "" if name is None else _profile_name(_text(name))


def _profile_name(text: str) -> str:
    """The profile at the end of an NVML name: "NVIDIA A100-SXM4-80GB MIG 3g.40gb" ->
    "3g.40gb", "MIG 1c.3g.40gb" -> "1c.3g.40gb"; "" when there is none."""
    last = text.strip().rsplit(maxsplit=1)[-1] if text.strip() else ""
    return last if _PROFILE_RE.fullmatch(last) else ""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(fn: Callable[[], Any], nv: Any) -> Any:
    """Some queries are unsupported on some boards (NVML_ERROR_NOT_SUPPORTED): None then."""
    try:
        return fn()
    except nv.NVMLError:
        return None
