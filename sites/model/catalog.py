"""The device catalog: the published figures of each device model, and the slices of one.

Each accelerator model is an entry of configs/devices.yaml with published DENSE peak figures
(a figure the vendor does not publish is null); the reference CPU entry (``cpu_reference``)
gives per-core figures. sites.model.capacity sums them into a site's normalized capacity.

Fractional accelerators: a GPU entry may list its MIG profiles (``mig:``). A slice of a device
is a pseudo-model named ``<model>/<part>``: ``A100-80GB/3g.40gb`` (a MIG instance) or
``A100-80GB/ts4`` (a quarter of a time-shared device). ``DeviceCatalog.get`` derives its figures
and ``DeviceCatalog.fraction`` its share of the device. A site cuts devices in
``inventory.devices[].partitions``; ``check_partitions`` tests the layouts against the hardware's
placement rules (sites.model.mig), ``expand`` gives the pools as placement sees them and
``device_slots`` the slot ids. Long form: docs/catalog.md.

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
from typing import Any, Literal

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

from sites.model.configs_home import configs_home
from sites.model.errors import SitesError
from sites.model.mig import Figure, MigProfile, MigSpec, layout_problem
from sites.model.spec import MAX_TIME_SLICES, DevicePool, Inventory

__all__ = [
    "SLICE_SEP",
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
    "partition_problems",
    "round_figure",
    "shared_model",
    "split_model",
]

CONFIG_DIR_ENV = "CPN_CONFIG_DIR"
MODEL_RE = r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,62}$"


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
    """devices.yaml: under $CPN_CONFIG_DIR when set, else in the configs cpn ships
    (sites.model.configs_home)."""
    config_dir = os.environ.get(CONFIG_DIR_ENV)
    if config_dir:
        return Path(config_dir) / "devices.yaml"
    return configs_home() / "devices.yaml"


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
            self._layouts[key] = self._mig_problem(model, layout)
        return self._layouts[key]

    def _mig_problem(self, model: str, layout: Mapping[str, int]) -> str | None:
        mig = self.get(model).mig
        if mig is None:
            with_mig = ", ".join(m for m, s in self.devices.items() if s.mig is not None)
            return f"{model} has no MIG profiles in the catalog (MIG models: {with_mig or 'none'})"
        return layout_problem(model, mig, layout)

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
        return None if figure is None else round_figure(figure * share)

    return DeviceSpec(
        description=description,
        vendor=base.vendor,
        kind=base.kind,
        fp64_tflops=part(base.fp64_tflops, fraction),
        fp32_tflops=part(base.fp32_tflops, fraction),
        fp16_tflops=part(base.fp16_tflops, fraction),
        int8_tops=part(base.int8_tops, fraction),
        mem_gb=round_figure(mem_gb),
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


def round_figure(value: float) -> float:
    """A figure or a sum of figures to 1e-6 (1 MFLOPS of a TFLOPS figure): sums of decimal
    figures pick up binary noise (0.1 + 0.2)."""
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
