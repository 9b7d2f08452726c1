"""Device catalog and normalized compute capacity.

A site declares concrete hardware (``{"H100": 1024}``, 112 cores x nodes, RAM, storage). Each
accelerator model is an entry of configs/devices.yaml with published DENSE peak figures. Its
normalized capacity sums, over the accelerators, count x fp64/fp32/fp16 TFLOPS, INT8 TOPS and
device memory (a figure the vendor does not publish is null and counts as 0). CPU cores
are scaled by the per-core figures of the catalog's reference CPU entry (``cpu_reference``),
giving ``cpu_fp64_tflops``; RAM and storage pass through. The concrete counts are kept next to
the sums, so a job can ask for ``H100: 8`` or for "800 FP16 TFLOPS on >= 80 GB devices" alike.
Long form: docs/catalog.md.

Exceptions (part of the sites tree, sites.errors)::

    SitesError
    └── CatalogError (also ValueError)     any catalog error; a cpu entry used as a device
        ├── InvalidCatalog                 a catalog file that cannot be read or is not valid
        └── UnknownDevice (also KeyError)  a device model the catalog does not have
"""

from __future__ import annotations

import difflib
import enum
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sites.errors import SitesError
from sites.spec import Inventory

__all__ = [
    "Capacity",
    "CatalogError",
    "DeviceCatalog",
    "DeviceKind",
    "DeviceSpec",
    "InvalidCatalog",
    "UnknownDevice",
    "default_path",
    "normalize",
    "normalize_inventory",
]

CONFIG_DIR_ENV = "CPN_CONFIG_DIR"
MODEL_RE = r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,62}$"

# strict: a YAML string or boolean is a mistake, not a number to coerce.
Figure = Annotated[float, Field(gt=0, strict=True)]
Amount = Annotated[float, Field(ge=0)]


class CatalogError(SitesError, ValueError):
    """Base of the catalog's errors: each is a bad value in a catalog, a site or a request."""


class InvalidCatalog(CatalogError):
    """A catalog file that cannot be read, parsed or validated.

    ``field`` is the dotted path of the first offending field (``devices.H100.fp16_tflops``),
    or None when the file as a whole is at fault.
    """

    def __init__(self, path: Path, field: str | None, message: str) -> None:
        self.path = path
        self.field = field
        self.message = message
        where = f"{path}: {field}" if field else str(path)
        super().__init__(f"{where}: {message}")


class UnknownDevice(CatalogError, KeyError):
    """A device model that the catalog does not list."""

    def __init__(self, model: str, known: tuple[str, ...]) -> None:
        self.model = model
        close = difflib.get_close_matches(model, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        self.message = (
            f"unknown device model {model!r}{hint} (catalog has: {', '.join(known) or 'nothing'})"
        )
        super().__init__(self.message)

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return self.message


class DeviceKind(enum.StrEnum):
    gpu = "gpu"
    npu = "npu"
    cpu = "cpu"


class DeviceSpec(BaseModel):
    """One catalog entry: published peak figures of one device model (per core for a CPU)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    description: str = Field(min_length=1)
    vendor: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    kind: DeviceKind
    fp64_tflops: Figure | None = Field(description="dense FP64 peak, TFLOPS; null: unpublished")
    fp32_tflops: Figure | None = Field(description="FP32 (not TF32) peak, TFLOPS")
    fp16_tflops: Figure | None = Field(description="dense FP16/BF16 tensor peak, TFLOPS")
    int8_tops: Figure | None = Field(description="dense INT8 tensor peak, TOPS")
    mem_gb: Figure | None = Field(description="device memory, GB")
    mem_bw_gbps: Figure | None = Field(description="device memory bandwidth, GB/s")
    power_w: Figure | None = Field(description="TDP, watts")
    nvml_names: tuple[str, ...] = Field(
        default=(), description="substrings of the NVML device name that identify this model"
    )
    basis: Literal["datasheet", "press", "derived"]
    sources: tuple[str, ...] = Field(min_length=1, description="where each figure comes from")

    @field_validator("nvml_names")
    @classmethod
    def _non_blank_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if not name.strip():
                raise ValueError("an NVML name must not be blank")
        return names

    @model_validator(mode="after")
    def _accelerator_figures(self) -> DeviceSpec:
        # Placement needs these for every accelerator; a CPU entry's memory is the site's RAM.
        if self.kind is not DeviceKind.cpu:
            missing = [
                name for name in ("fp16_tflops", "mem_gb", "power_w") if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"an accelerator needs {', '.join(missing)} (got null)")
        elif self.nvml_names:
            raise ValueError("a cpu entry has no NVML names")
        return self


def default_path() -> Path:
    """configs/devices.yaml: under $CPN_CONFIG_DIR when set, else next to the package."""
    config_dir = os.environ.get(CONFIG_DIR_ENV)
    if config_dir:
        return Path(config_dir) / "devices.yaml"
    return Path(__file__).resolve().parent.parent / "configs" / "devices.yaml"


class DeviceCatalog(BaseModel):
    """The catalog: device model name -> DeviceSpec, plus the reference CPU entry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: dict[str, DeviceSpec] = Field(min_length=1)
    cpu_reference: str = Field(
        default="CPU",
        validate_default=True,
        description="entry whose per-core figures normalize cpu_cores",
    )

    @field_validator("devices")
    @classmethod
    def _names_and_nvml(cls, devices: dict[str, DeviceSpec]) -> dict[str, DeviceSpec]:
        owner: dict[str, str] = {}
        for model, spec in devices.items():
            if not _is_model_name(model):
                raise ValueError(f"model name {model!r} must match {MODEL_RE}")
            for name in spec.nvml_names:
                other = owner.setdefault(name.casefold(), model)
                if other != model:
                    raise ValueError(f"NVML name {name!r} is claimed by both {other} and {model}")
        return devices

    @field_validator("cpu_reference")
    @classmethod
    def _cpu_reference_is_cpu(cls, model: str, info: ValidationInfo) -> str:
        devices: dict[str, DeviceSpec] | None = info.data.get("devices")
        if devices is None:  # devices already failed; that error is reported instead
            return model
        spec = devices.get(model)
        if spec is None:
            raise ValueError(f"no entry {model!r} in devices")
        if spec.kind is not DeviceKind.cpu:
            raise ValueError(f"entry {model!r} is a {spec.kind}, not a cpu")
        return model

    @staticmethod
    def default_path() -> Path:
        """Where load() reads from when given no path; see the module-level default_path()."""
        return default_path()

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> DeviceCatalog:
        """Read and validate a catalog file (default: default_path()).

        Raises InvalidCatalog naming the file and the first offending field.
        """
        file = Path(path) if path is not None else default_path()
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidCatalog(file, None, f"cannot read: {exc.strerror or exc}") from exc
        try:
            raw = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as exc:
            raise InvalidCatalog(file, None, f"not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise InvalidCatalog(file, None, "expected a mapping with a 'devices' key")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            field, message = _describe(exc)
            raise InvalidCatalog(file, field, message) from exc

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self.devices))

    @property
    def cpu(self) -> DeviceSpec:
        """The reference CPU entry (per-core figures)."""
        return self.devices[self.cpu_reference]

    def get(self, model: str) -> DeviceSpec:
        """The entry for ``model``; raises UnknownDevice if the catalog has none."""
        spec = self.devices.get(model)
        if spec is None:
            raise UnknownDevice(model, self.models)
        return spec

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and model in self.devices

    def match_nvml(self, name: str) -> str | None:
        """Catalog model for an NVML device name, by the longest contained nvml_names entry."""
        haystack = name.casefold()
        best: tuple[int, str] | None = None
        for model, spec in self.devices.items():
            for needle in spec.nvml_names:
                if needle.casefold() in haystack:
                    # longest needle wins; ties go to the alphabetically first model (stable)
                    candidate = (-len(needle), model)
                    if best is None or candidate < best:
                        best = candidate
        return None if best is None else best[1]


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
            name: _round(max(0.0, getattr(self, name) - getattr(used, name)))
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
        fp64_tflops=_round(fp64),
        fp32_tflops=_round(fp32),
        fp16_tflops=_round(fp16),
        int8_tops=_round(int8),
        accel_mem_gb=_round(accel_mem),
        cpu_cores=cpu_cores,
        cpu_fp64_tflops=_round(cpu_cores * (catalog.cpu.fp64_tflops or 0.0)),
        mem_gb=float(mem_gb),
        storage_tb=float(storage_tb),
    )


def normalize_inventory(inventory: Inventory, catalog: DeviceCatalog) -> Capacity:
    """normalize() for a site's declared inventory (sites.spec.Inventory)."""
    return normalize(
        devices={pool.model: pool.count for pool in inventory.devices},
        cpu_cores=inventory.cpu_cores,
        mem_gb=inventory.mem_gb,
        storage_tb=inventory.storage_tb,
        catalog=catalog,
    )


def _round(value: float) -> float:
    # Sums of decimal figures pick up binary noise (0.1 + 0.2); 1e-6 TFLOPS is 1 MFLOPS.
    return round(value, 6)


def _is_model_name(model: str) -> bool:
    return re.fullmatch(MODEL_RE, model) is not None


def _describe(exc: ValidationError) -> tuple[str | None, str]:
    """(dotted path of the first error, its message plus any others) for InvalidCatalog."""
    located = [
        (".".join(str(part) for part in error["loc"]), str(error["msg"]))
        for error in exc.errors(include_url=False)
    ]
    if not located:
        return None, str(exc)
    field, message = located[0]
    if len(located) > 1:
        others = "; ".join(f"{loc or '(top level)'}: {msg}" for loc, msg in located[1:])
        message = f"{message} (also {others})"
    return field or None, message


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (plain PyYAML keeps the last silently)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)
