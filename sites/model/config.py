"""Onboarding from config: read site files, validate them, report every problem with its path.

`load_site(path, catalog)` returns a SiteSpec or raises ConfigError listing each problem as
(file, dotted field path, reason); `load_sites(paths, catalog)` does the same for many files and
also checks ids are unique.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from sites.model.catalog import DeviceCatalog, partition_problems
from sites.model.configs_home import configs_home
from sites.model.errors import ConfigError, Problem
from sites.model.spec import SiteSpec

M = TypeVar("M", bound=BaseModel)


def config_dir() -> Path:
    """$CPN_CONFIG_DIR, else the configs cpn ships (sites.model.configs_home)."""
    env = os.environ.get("CPN_CONFIG_DIR")
    if env:
        return Path(env)
    return configs_home()


def field_path(loc: Iterable[int | str]) -> str:
    """('inventory', 'devices', 0, 'model') -> 'inventory.devices[0].model'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


# libyaml's loader when PyYAML was built with it: ten times the pure-Python one (a demo site
# file: 2.2 ms -> 0.2 ms), the same documents from the same safe tag set
_SAFE_LOADER: type[yaml.SafeLoader] | type[yaml.CSafeLoader] = getattr(
    yaml, "CSafeLoader", yaml.SafeLoader
)


def read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([Problem(str(path), "", f"cannot read: {exc.strerror or exc}")]) from exc
    try:
        return yaml.load(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem(str(path), "", f"invalid YAML: {where}{reason}")]) from exc


def validation_problems(source: str, exc: ValidationError) -> list[Problem]:
    return [Problem(source, field_path(err["loc"]), err["msg"]) for err in exc.errors()]


def check_spec(source: str, spec: SiteSpec, catalog: DeviceCatalog) -> list[Problem]:
    """Checks that span fields or need the catalog, each with the exact field path."""
    problems: list[Problem] = []
    for i, pool in enumerate(spec.inventory.devices):
        if pool.model not in catalog:
            known = ", ".join(sorted(catalog.devices))
            problems.append(
                Problem(
                    source,
                    f"inventory.devices[{i}].model",
                    f"unknown device model {pool.model!r} (catalog has: {known})",
                )
            )
        if pool.model not in spec.prices.usd_per_gpu_hour:
            problems.append(
                Problem(
                    source,
                    f"prices.usd_per_gpu_hour.{pool.model}",
                    f"no price for {pool.model}, which inventory.devices[{i}] declares",
                )
            )
    problems += [
        Problem(source, p.field, p.message) for p in partition_problems(spec.inventory, catalog)
    ]
    if spec.perception.mode == "host":
        for i, pool in enumerate(spec.inventory.devices):
            for j, partition in enumerate(pool.partitions):
                if partition.time_slices is not None:
                    problems.append(
                        Problem(
                            source,
                            f"inventory.devices[{i}].partitions[{j}].time_slices",
                            "a host-mode agent hands out the GPUs NVML shows (MIG instances, "
                            "whole devices), not time slices",
                        )
                    )
    problems += _check_slurm(source, spec, catalog)
    problems += _check_sharing(source, spec, catalog)
    seen: set[str] = set()
    for i, svc in enumerate(spec.services):
        if svc.name in seen:
            problems.append(Problem(source, f"services[{i}].name", f"{svc.name!r} listed twice"))
        seen.add(svc.name)
    return problems


def _check_sharing(source: str, spec: SiteSpec, catalog: DeviceCatalog) -> list[Problem]:
    """A sharing pool (docs/gpu-sharing.md): MPS on NVIDIA devices only; none at a Slurm site,
    whose scheduler shares GPUs by its own GRES (shard, mps) and would give a share's run a
    whole device."""
    problems = []
    for i, pool in enumerate(spec.inventory.devices):
        if pool.sharing is None:
            continue
        where = f"inventory.devices[{i}].sharing"
        if spec.executor.kind == "slurm":
            problems.append(
                Problem(
                    source,
                    where,
                    "a Slurm site shares GPUs by Slurm's own GRES (shard, mps); declare "
                    "time slices under partitions instead",
                )
            )
        elif pool.sharing == "mps" and pool.model in catalog.devices:
            vendor = catalog.devices[pool.model].vendor
            if vendor != "nvidia":
                problems.append(
                    Problem(
                        source,
                        where,
                        f"MPS is NVIDIA's; {pool.model} is a {vendor} device: use time-slicing",
                    )
                )
    return problems


def _check_slurm(source: str, spec: SiteSpec, catalog: DeviceCatalog) -> list[Problem]:
    """GRES types name catalog models, one type per model (the collector maps them back)."""
    slurm = spec.executor.slurm
    if slurm is None:
        return []
    problems = []
    by_type: dict[str, str] = {}
    for model, kind in slurm.gres_types.items():
        where = f"executor.slurm.gres_types.{model}"
        if model not in catalog:
            known = ", ".join(sorted(catalog.devices))
            problems.append(
                Problem(source, where, f"unknown device model {model!r} (catalog has: {known})")
            )
        if kind.lower() in by_type:
            problems.append(
                Problem(source, where, f"GRES type {kind!r} is also {by_type[kind.lower()]!r}'s")
            )
        by_type[kind.lower()] = model
    return problems


def validate_mapping(source: str, data: Any, model: type[M], what: str) -> M:
    """`data` (parsed YAML) as `model`; ConfigError naming `source` and each field at fault."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise ConfigError([Problem(source, "", f"expected a mapping {what}, got {kind}")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(source, exc)) from None


def parse_site(source: str, data: Any, catalog: DeviceCatalog) -> SiteSpec:
    spec = validate_mapping(source, data, SiteSpec, "of site fields")
    problems = check_spec(source, spec, catalog)
    if problems:
        raise ConfigError(problems)
    return spec


def load_site(path: Path, catalog: DeviceCatalog) -> SiteSpec:
    return parse_site(str(path), read_yaml(path), catalog)


def load_sites(paths: Iterable[Path], catalog: DeviceCatalog) -> list[SiteSpec]:
    """Validate every file; raise one ConfigError with all problems of all files."""
    problems: list[Problem] = []
    specs: list[SiteSpec] = []
    where: dict[str, str] = {}
    for path in paths:
        try:
            spec = load_site(path, catalog)
        except ConfigError as exc:
            problems += exc.problems
            continue
        if spec.id in where:
            problems.append(
                Problem(str(path), "id", f"{spec.id!r} is also defined in {where[spec.id]}")
            )
            continue
        where[spec.id] = str(path)
        specs.append(spec)
    if problems:
        raise ConfigError(problems)
    return specs


def site_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.yaml") if p.is_file())
