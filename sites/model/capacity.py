"""Normalized compute capacity (`Capacity`), made from a concrete inventory with the device
catalog (`normalize`, pure).

A site declares concrete hardware (``{"H100": 1024}``, 112 cores x nodes, RAM, storage). Its
normalized capacity sums, over the accelerators, count x fp64/fp32/fp16 TFLOPS, INT8 TOPS and
device memory (a figure the catalog has as null counts as 0). CPU cores are scaled by the
per-core figures of the catalog's reference CPU entry, giving ``cpu_fp64_tflops``; RAM and
storage pass through. The concrete counts are kept next to the sums, so a job can ask for
``H100: 8`` or for "800 FP16 TFLOPS on >= 80 GB devices" alike. Each physical device counts
once, partitioned or not. Long form: docs/catalog.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from sites.model.catalog import (
    CatalogError,
    DeviceCatalog,
    DeviceKind,
    check_partitions,
    round_figure,
)
from sites.model.spec import Inventory

Amount = Annotated[float, Field(ge=0)]


class Capacity(BaseModel):
    """A site's capacity, concrete (``devices``) and normalized (the sums).

    Accelerator sums cover gpu/npu devices only; CPU compute is ``cpu_fp64_tflops``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="device model -> count"
    )
    fp64_tflops: Amount = 0.0
    fp32_tflops: Amount = 0.0
    fp16_tflops: Amount = 0.0
    int8_tops: Amount = 0.0
    accel_mem_gb: Amount = 0.0
    cpu_cores: int = Field(default=0, ge=0)
    cpu_fp64_tflops: Amount = 0.0
    mem_gb: Amount = 0.0
    storage_tb: Amount = 0.0

    @classmethod
    def zero(cls) -> Capacity:
        return cls()

    def minus(self, used: Capacity) -> Capacity:
        """What is left after ``used``, clamped at 0.

        Models of self stay listed (0 when exhausted); models only in ``used`` are ignored.
        """
        devices = {m: max(0, n - used.devices.get(m, 0)) for m, n in self.devices.items()}
        amounts = {
            name: round_figure(max(0.0, getattr(self, name) - getattr(used, name)))
            for name in _FLOAT_FIELDS
        }
        return Capacity(
            devices=devices, cpu_cores=max(0, self.cpu_cores - used.cpu_cores), **amounts
        )


_FLOAT_FIELDS = (
    "fp64_tflops",
    "fp32_tflops",
    "fp16_tflops",
    "int8_tops",
    "accel_mem_gb",
    "cpu_fp64_tflops",
    "mem_gb",
    "storage_tb",
)


def normalize(
    *,
    devices: Mapping[str, int],
    cpu_cores: int,
    mem_gb: float,
    storage_tb: float,
    catalog: DeviceCatalog,
) -> Capacity:
    """Concrete inventory -> Capacity (pure). Unknown models raise UnknownDevice."""
    if cpu_cores < 0 or mem_gb < 0 or storage_tb < 0:
        raise ValueError("cpu_cores, mem_gb and storage_tb must be >= 0")
    fp64 = fp32 = fp16 = int8 = accel_mem = 0.0
    counts: dict[str, int] = {}
    for model, count in devices.items():
        spec = catalog.get(model)
        if spec.kind is DeviceKind.cpu:
            raise CatalogError(f"{model!r} is a cpu entry; declare CPUs as cpu_cores")
        if count < 0:
            raise ValueError(f"device count for {model!r} must be >= 0, got {count}")
        counts[model] = count
        fp64 += count * (spec.fp64_tflops or 0.0)
        fp32 += count * (spec.fp32_tflops or 0.0)
        fp16 += count * (spec.fp16_tflops or 0.0)
        int8 += count * (spec.int8_tops or 0.0)
        accel_mem += count * (spec.mem_gb or 0.0)
    return Capacity(
        devices=counts,
        fp64_tflops=round_figure(fp64),
        fp32_tflops=round_figure(fp32),
        fp16_tflops=round_figure(fp16),
        int8_tops=round_figure(int8),
        accel_mem_gb=round_figure(accel_mem),
        cpu_cores=cpu_cores,
        cpu_fp64_tflops=round_figure(cpu_cores * (catalog.cpu.fp64_tflops or 0.0)),
        mem_gb=float(mem_gb),
        storage_tb=float(storage_tb),
    )


def normalize_inventory(inventory: Inventory, catalog: DeviceCatalog) -> Capacity:
    """normalize() for a site's declared inventory (sites.model.spec.Inventory).

    Each physical device counts once, under its model, partitioned or not; a partition layout
    the hardware cannot hold raises InvalidPartition (check_partitions).
    """
    check_partitions(inventory, catalog)
    return normalize(
        devices={pool.model: pool.count for pool in inventory.devices},
        cpu_cores=inventory.cpu_cores,
        mem_gb=inventory.mem_gb,
        storage_tb=inventory.storage_tb,
        catalog=catalog,
    )
