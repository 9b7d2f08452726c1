"""Device catalog and normalized compute capacity.

A site declares concrete hardware (``{"H100": 1024}``, 112 cores x nodes, RAM, storage). Each
accelerator model is an entry of configs/devices.yaml with published DENSE peak figures. Its
normalized capacity sums, over the accelerators, count x fp64/fp32/fp16 TFLOPS, INT8 TOPS and
device memory (a figure the vendor does not publish is null and counts as 0). CPU cores
are scaled by the per-core figures of the catalog's reference CPU entry (``cpu_reference``),
giving ``cpu_fp64_tflops``; RAM and storage pass through. The concrete counts are kept next to
the sums, so a job can ask for ``H100: 8`` or for "800 FP16 TFLOPS on >= 80 GB devices" alike.

Fractional accelerators: a GPU entry may list its MIG profiles (``mig:``). A slice of a device
is a pseudo-model named ``<model>/<part>``: ``A100-80GB/3g.40gb`` (a MIG instance) or
``A100-80GB/ts4`` (a quarter of a time-shared device). ``DeviceCatalog.get`` derives its figures
and ``DeviceCatalog.fraction`` its share of the device. A site cuts devices in
``inventory.devices[].partitions``; ``check_partitions`` tests the layouts against the hardware's
placement rules, ``expand`` gives the pools as placement sees them and ``device_slots`` the
slot ids. Capacity sums count each physical device once. Long form: docs/catalog.md.

Exceptions (part of the sites tree, sites.model.errors)::

    SitesError
    └── CatalogError (also ValueError)     any catalog error; a cpu entry used as a device
        ├── InvalidCatalog                 a catalog file that cannot be read or is not valid
        ├── InvalidPartition               a site's partitions the device cannot hold; `field`
        └── UnknownDevice (also KeyError)  a device model (or slice of one) the catalog lacks
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
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sites.model.errors import SitesError
from sites.model.spec import MAX_TIME_SLICES, MIG_PROFILE_RE, DevicePool, Inventory

__all__ = [
    "SLICE_SEP",
    "Capacity",
    "CatalogError",
    "DeviceCatalog",
    "DeviceKind",
    "DeviceSpec",
    "InvalidCatalog",
    "InvalidPartition",
    "MigProfile",
    "MigSpec",
    "UnknownDevice",
    "check_partitions",
    "default_path",
    "device_slots",
    "expand",
    "mig_fit",
    "mig_model",
    "normalize",
    "normalize_inventory",
    "partition_problems",
    "shared_model",
    "split_model",
]

CONFIG_DIR_ENV = "CPN_CONFIG_DIR"
MODEL_RE = r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,62}$"

# strict: a YAML string or boolean is a mistake, not a number to coerce.
Figure = Annotated[float, Field(gt=0, strict=True)]
Amount = Annotated[float, Field(ge=0)]

SLICE_SEP = "/"
_TIME_SLICES_RE = re.compile(r"ts([0-9]{1,3})")


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


class InvalidPartition(CatalogError):
    """A site's partitions that the catalog's hardware cannot hold (a MIG profile the model
    lacks, more instances than fit one device). ``field`` is the dotted path of the offending
    field (``inventory.devices[0].partitions[1].mig``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class UnknownDevice(CatalogError, KeyError):
    """A device model that the catalog does not list, or a slice of one it cannot derive
    (``message`` then says why: the profile the model lacks and the ones it has)."""

    def __init__(self, model: str, known: tuple[str, ...], message: str | None = None) -> None:
        self.model = model
        if message is None:
            close = difflib.get_close_matches(model, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = (
                f"unknown device model {model!r}{hint} "
                f"(catalog has: {', '.join(known) or 'nothing'})"
            )
        self.message = message
        super().__init__(self.message)

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return self.message


class DeviceKind(enum.StrEnum):
    gpu = "gpu"
    npu = "npu"
    cpu = "cpu"


class MigProfile(BaseModel):
    """One MIG GPU-instance profile: its slices of the device and where it may start.

    ``starts`` are the memory-slice indices NVML allows a GPU instance of this profile to begin
    at (``nvidia-smi mig -lgipp``; nvmlGpuInstancePlacement_t.start); the instance occupies
    memory slices [start, start + memory_slices) and compute slices
    [start, start + compute_slices).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_slices: int = Field(ge=1, le=32, description="compute (GPC) slices it takes")
    memory_slices: int = Field(ge=1, le=32, description="memory slices it takes")
    mem_gb: Figure = Field(description="device memory of the instance, GB (the profile's name)")
    max_instances: int = Field(ge=1, le=32, description="instances one device holds at most")
    starts: tuple[Annotated[int, Field(ge=0, le=31)], ...] = Field(
        min_length=1, description="allowed start slice indices"
    )

    @field_validator("starts")
    @classmethod
    def _sorted_unique(cls, starts: tuple[int, ...]) -> tuple[int, ...]:
        if list(starts) != sorted(set(starts)):
            raise ValueError("starts must be ascending and distinct")
        return starts


class MigSpec(BaseModel):
    """A GPU's Multi-Instance GPU geometry: its slices and the profiles it can be cut into."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_slices: int = Field(ge=1, le=32, description="compute slices of the whole device")
    memory_slices: int = Field(ge=1, le=32, description="memory slices of the whole device")
    profiles: dict[str, MigProfile] = Field(min_length=1, description="name -> profile")

    @model_validator(mode="after")
    def _profiles_fit(self) -> MigSpec:
        for name, profile in self.profiles.items():
            if not re.fullmatch(MIG_PROFILE_RE, name):
                raise ValueError(f"profile name {name!r} must match {MIG_PROFILE_RE}")
            for start in profile.starts:
                if (
                    start + profile.compute_slices > self.compute_slices
                    or start + profile.memory_slices > self.memory_slices
                ):
                    raise ValueError(
                        f"profile {name}: start {start} runs past the device's "
                        f"{self.compute_slices} compute / {self.memory_slices} memory slices"
                    )
        return self


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
    mig: MigSpec | None = Field(default=None, description="MIG geometry and profiles")

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
        if self.mig is not None:
            if self.kind is not DeviceKind.gpu:
                raise ValueError("only a gpu has MIG profiles")
            for name, profile in self.mig.profiles.items():
                if self.mem_gb is not None and profile.mem_gb > self.mem_gb:
                    raise ValueError(f"MIG profile {name} has more memory than the device")
        return self


def default_path() -> Path:
    """configs/devices.yaml: under $CPN_CONFIG_DIR when set, else next to the package."""
    config_dir = os.environ.get(CONFIG_DIR_ENV)
    if config_dir:
        return Path(config_dir) / "devices.yaml"
    return Path(__file__).resolve().parents[2] / "configs" / "devices.yaml"


class DeviceCatalog(BaseModel):
    """The catalog: device model name -> DeviceSpec, plus the reference CPU entry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: dict[str, DeviceSpec] = Field(min_length=1)
    cpu_reference: str = Field(
        default="CPU",
        validate_default=True,
        description="entry whose per-core figures normalize cpu_cores",
    )
    # Caches (derived on hot paths; the catalog is immutable, so they never go stale):
    # pseudo-model -> (derived spec, fraction); (model, MIG layout) -> why it fails or None.
    _slices: dict[str, tuple[DeviceSpec, float]] = PrivateAttr(default_factory=dict)
    _layouts: dict[tuple[str, tuple[tuple[str, int], ...]], str | None] = PrivateAttr(
        default_factory=dict
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

    def __eq__(self, other: object) -> bool:
        # pydantic compares private attributes too; the caches are not part of the value
        if not isinstance(other, DeviceCatalog):
            return NotImplemented
        return (self.devices, self.cpu_reference) == (other.devices, other.cpu_reference)

    __hash__ = None  # type: ignore[assignment]  # a dict of entries: not hashable

    def get(self, model: str) -> DeviceSpec:
        """The entry for ``model``, or for a slice (``A100-80GB/3g.40gb``, ``H100/ts4``) one
        derived from its device's entry; raises UnknownDevice if there is none."""
        spec = self.devices.get(model)
        if spec is not None:
            return spec
        return self._slice(model)[0]

    def fraction(self, model: str) -> float:
        """The share of one physical device that ``model`` is: 1.0 for a whole device, the
        profile's compute slices / the device's for a MIG instance, 1/N for a time slice."""
        if model in self.devices:
            return 1.0
        return self._slice(model)[1]

    def __contains__(self, model: object) -> bool:
        if not isinstance(model, str):
            return False
        if model in self.devices:
            return True
        try:
            self._slice(model)
        except UnknownDevice:
            return False
        return True

    def _slice(self, model: str) -> tuple[DeviceSpec, float]:
        cached = self._slices.get(model)
        if cached is None:
            cached = self._slices[model] = self._derive(model)
        return cached

    def _derive(self, model: str) -> tuple[DeviceSpec, float]:
        base_name, part = split_model(model)
        base = self.devices.get(base_name)
        if part is None or base is None:
            raise UnknownDevice(model if base is None else base_name, self.models)
        if base.kind is DeviceKind.cpu:
            raise UnknownDevice(model, self.models, f"{base_name} is a cpu entry; it has no slices")
        shares = _TIME_SLICES_RE.fullmatch(part)
        if shares is not None:
            n = int(shares.group(1))
            if not 2 <= n <= MAX_TIME_SLICES:
                raise UnknownDevice(
                    model,
                    self.models,
                    f"{model!r}: a time-sliced share is {base_name}/tsN, N from 2 to "
                    f"{MAX_TIME_SLICES}",
                )
            spec = _scaled(
                base,
                fraction=1.0 / n,
                mem_gb=(base.mem_gb or 0.0) / n,
                mem_fraction=1.0 / n,
                description=f"1/{n} time-sliced share of one {base.description}",
                source=f"derived: {base_name} figures / {n} (time slicing, memory not isolated)",
            )
            return spec, 1.0 / n
        profile = base.mig.profiles.get(part) if base.mig is not None else None
        if base.mig is None or profile is None:
            raise UnknownDevice(model, self.models, _no_profile(base_name, base, part))
        fraction = profile.compute_slices / base.mig.compute_slices
        spec = _scaled(
            base,
            fraction=fraction,
            mem_gb=profile.mem_gb,
            mem_fraction=profile.memory_slices / base.mig.memory_slices,
            description=(
                f"MIG {part} instance ({profile.compute_slices}/{base.mig.compute_slices} "
                f"compute, {profile.memory_slices}/{base.mig.memory_slices} memory slices) of "
                f"one {base.description}"
            ),
            source=(
                f"derived: {base_name} figures x {profile.compute_slices}/"
                f"{base.mig.compute_slices} compute slices; memory bandwidth x "
                f"{profile.memory_slices}/{base.mig.memory_slices} memory slices"
            ),
        )
        return spec, fraction

    def mig_fit(self, model: str, layout: Mapping[str, int]) -> str | None:
        """Why ``layout`` (MIG profile -> instances) does not fit ONE ``model`` device, or None
        when it fits. Exact: a backtracking search over the profiles' allowed starts."""
        key = (model, tuple(layout.items()))
        if key not in self._layouts:
            self._layouts[key] = _mig_problem(model, self.get(model), layout, self)
        return self._layouts[key]

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


def split_model(name: str) -> tuple[str, str | None]:
    """``"A100-80GB/3g.40gb"`` -> ``("A100-80GB", "3g.40gb")``; a whole model -> (name, None)."""
    base, sep, part = name.partition(SLICE_SEP)
    return base, (part if sep else None)


def mig_model(base: str, profile: str) -> str:
    """The pseudo-model of a MIG instance: ``mig_model("A100-80GB", "3g.40gb")``."""
    return f"{base}{SLICE_SEP}{profile}"


def shared_model(base: str, slices: int) -> str:
    """The pseudo-model of a 1/``slices`` time-sliced share: ``shared_model("H100", 4)``."""
    return f"{base}{SLICE_SEP}ts{slices}"


def mig_fit(model: str, layout: Mapping[str, int], catalog: DeviceCatalog) -> str | None:
    """DeviceCatalog.mig_fit: why ``layout`` does not fit one ``model`` device, or None."""
    return catalog.mig_fit(model, layout)


def partition_problems(inventory: Inventory, catalog: DeviceCatalog) -> list[InvalidPartition]:
    """Every partition of ``inventory`` that the catalog's hardware cannot hold.

    A pool whose model the catalog lacks is skipped: that is reported on its own (UnknownDevice,
    or sites.model.config's check of the model).
    """
    problems: list[InvalidPartition] = []
    for i, pool in enumerate(inventory.devices):
        if pool.model not in catalog.devices:
            continue
        for j, partition in enumerate(pool.partitions):
            if partition.mig is not None:
                why = catalog.mig_fit(pool.model, partition.mig)
                if why is not None:
                    problems.append(
                        InvalidPartition(f"inventory.devices[{i}].partitions[{j}].mig", why)
                    )
    return problems


def check_partitions(inventory: Inventory, catalog: DeviceCatalog) -> None:
    """Raise InvalidPartition (with its ``field``) for the first partition the hardware cannot
    hold: a MIG profile the model lacks, more instances than one device takes, or instances
    that cannot sit at non-overlapping allowed starts (NVIDIA's placement rules)."""
    problems = partition_problems(inventory, catalog)
    if problems:
        raise problems[0]


def expand(inventory: Inventory, catalog: DeviceCatalog) -> dict[str, int]:
    """The pools as placement sees them: (pseudo-)model -> slots.

    Whole devices stay under the model (omitted when none is left whole); each MIG profile is
    ``<model>/<profile>`` -> devices x instances, each time-sliced share ``<model>/tsN`` ->
    devices x N, summed over the partitions.
    """
    check_partitions(inventory, catalog)
    slots: dict[str, int] = {}
    for pool in inventory.devices:
        for model, n in _pool_counts(pool):
            slots[model] = slots.get(model, 0) + n
    return slots


def device_slots(
    pool: DevicePool, catalog: DeviceCatalog
) -> dict[str, tuple[tuple[int, str], ...]]:
    """Per (pseudo-)model of ``pool``, its slots in a stable order: (device index, slot id).

    Device indices count the pool's physical devices: the partitions' in declaration order from
    0, then the whole ones. The slot id is "" for a whole device, ``"<index>:<profile>:<k>"``
    for the k-th MIG instance of that profile on the device, ``"<index>:ts:<k>"`` for its k-th
    time-sliced share. Profiles of one device are listed by name.
    """
    for j, partition in enumerate(pool.partitions):
        if partition.mig is not None:
            why = catalog.mig_fit(pool.model, partition.mig)
            if why is not None:
                raise InvalidPartition(f"partitions[{j}].mig", why)
    slots: dict[str, list[tuple[int, str]]] = {}
    index = 0
    for partition in pool.partitions:
        for _ in range(partition.devices):
            if partition.mig is not None:
                for profile in sorted(partition.mig):
                    key = mig_model(pool.model, profile)
                    slots.setdefault(key, []).extend(
                        (index, f"{index}:{profile}:{k}") for k in range(partition.mig[profile])
                    )
            elif partition.time_slices is not None:
                key = shared_model(pool.model, partition.time_slices)
                slots.setdefault(key, []).extend(
                    (index, f"{index}:ts:{k}") for k in range(partition.time_slices)
                )
            index += 1
    if index < pool.count:
        slots[pool.model] = [(i, "") for i in range(index, pool.count)]
    return {model: tuple(found) for model, found in slots.items()}


def _pool_counts(pool: DevicePool) -> list[tuple[str, int]]:
    counts: list[tuple[str, int]] = []
    if pool.whole:
        counts.append((pool.model, pool.whole))
    for partition in pool.partitions:
        if partition.mig is not None:
            for profile, n in partition.mig.items():
                counts.append((mig_model(pool.model, profile), partition.devices * n))
        elif partition.time_slices is not None:
            counts.append(
                (
                    shared_model(pool.model, partition.time_slices),
                    partition.devices * partition.time_slices,
                )
            )
    return counts


def _scaled(
    base: DeviceSpec,
    *,
    fraction: float,
    mem_gb: float,
    mem_fraction: float,
    description: str,
    source: str,
) -> DeviceSpec:
    def part(figure: float | None, share: float) -> float | None:
        return None if figure is None else _round(figure * share)

    return DeviceSpec(
        description=description,
        vendor=base.vendor,
        kind=base.kind,
        fp64_tflops=part(base.fp64_tflops, fraction),
        fp32_tflops=part(base.fp32_tflops, fraction),
        fp16_tflops=part(base.fp16_tflops, fraction),
        int8_tops=part(base.int8_tops, fraction),
        mem_gb=_round(mem_gb),
        mem_bw_gbps=part(base.mem_bw_gbps, mem_fraction),
        power_w=part(base.power_w, fraction),
        basis="derived",
        sources=(source, *base.sources),
    )


def _no_profile(base_name: str, base: DeviceSpec, part: str) -> str:
    if base.mig is None:
        return (
            f"{base_name} has no MIG profiles in the catalog, so no {base_name}/{part}; "
            f"a time-sliced share is {base_name}/tsN (N from 2 to {MAX_TIME_SLICES})"
        )
    return (
        f"{base_name} has no MIG profile {part!r} "
        f"(its profiles: {', '.join(base.mig.profiles)}; or {base_name}/tsN for a time slice)"
    )


def _mig_problem(
    model: str, spec: DeviceSpec, layout: Mapping[str, int], catalog: DeviceCatalog
) -> str | None:
    """Why ``layout`` does not fit one device, or None.

    NVIDIA's placement rules (MIG User Guide, "Concepts > Partitioning" and "Supported MIG
    Profiles"; NVML nvmlDeviceGetGpuInstancePossiblePlacements): a GPU instance of a profile
    starts only at that profile's allowed slice indices, occupies memory slices
    [start, start + memory_slices), and may not overlap an occupied slice; a profile has a
    maximum instance count per device. Compute slices [start, start + compute_slices) are kept
    apart as well.
    """
    mig = spec.mig
    if mig is None:
        with_mig = ", ".join(m for m, s in catalog.devices.items() if s.mig is not None)
        return f"{model} has no MIG profiles in the catalog (MIG models: {with_mig or 'none'})"
    what = " + ".join(f"{profile} x {n}" for profile, n in layout.items())
    unknown = [profile for profile in layout if profile not in mig.profiles]
    if unknown:
        return (
            f"{model} has no MIG profile {unknown[0]!r} (its profiles: {', '.join(mig.profiles)})"
        )
    compute = sum(mig.profiles[p].compute_slices * n for p, n in layout.items())
    if compute > mig.compute_slices:
        return f"{what} does not fit one {model}: {compute} of {mig.compute_slices} compute slices"
    memory = sum(mig.profiles[p].memory_slices * n for p, n in layout.items())
    if memory > mig.memory_slices:
        return f"{what} does not fit one {model}: {memory} of {mig.memory_slices} memory slices"
    for profile, n in layout.items():
        most = mig.profiles[profile].max_instances
        if n > most:
            return f"{what} does not fit one {model}: at most {most} {profile} on one device"
    # largest first: they have the fewest starts, so the search fails (or succeeds) early
    instances = sorted(
        (name for name, n in layout.items() for _ in range(n)),
        key=lambda name: (
            -mig.profiles[name].memory_slices,
            -mig.profiles[name].compute_slices,
            name,
        ),
    )
    if not _place(instances, mig, 0, 0, 0, -1):
        return (
            f"{what} does not fit one {model}: no non-overlapping allowed start slices for them "
            "(NVIDIA MIG placement rules)"
        )
    return None


def _place(
    instances: list[str], mig: MigSpec, k: int, compute: int, memory: int, after: int
) -> bool:
    """Backtracking: can instances[k:] start at free allowed slices? ``compute`` and ``memory``
    are bit masks of occupied slices; ``after`` the start of the previous identical instance
    (identical instances are taken in ascending starts, so no arrangement is tried twice)."""
    if k == len(instances):
        return True
    profile = mig.profiles[instances[k]]
    same = k > 0 and instances[k - 1] == instances[k]
    for start in profile.starts:
        if same and start <= after:
            continue
        c = ((1 << profile.compute_slices) - 1) << start
        m = ((1 << profile.memory_slices) - 1) << start
        if c & compute or m & memory:
            continue
        if _place(instances, mig, k + 1, compute | c, memory | m, start):
            return True
    return False


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
