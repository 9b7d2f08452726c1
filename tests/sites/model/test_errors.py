"""The sites exception tree: every error the package raises on purpose is a SitesError, keeps
the built-in base its callers catch, and is drawn in sites/model/errors.py's docstring."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import sites
import sites.model.errors
from sites.model.capacity import normalize
from sites.model.catalog import CatalogError, DeviceCatalog, InvalidCatalog, UnknownDevice
from sites.model.errors import SitesError
from sites.model.latency import LatencyConfigError, LatencyModel, load_matrix_csv


def test_catalog_errors_are_sites_errors_and_keep_their_builtin_bases(tmp_path: Path) -> None:
    bad = tmp_path / "devices.yaml"
    bad.write_text("cpu_reference: CPU\ndevices: [not, a, mapping]\n")
    with pytest.raises(InvalidCatalog) as invalid:
        DeviceCatalog.load(bad)
    assert isinstance(invalid.value, SitesError)
    assert isinstance(invalid.value, ValueError)
    assert isinstance(invalid.value, CatalogError)

    catalog = DeviceCatalog.load()
    with pytest.raises(UnknownDevice) as unknown:
        catalog.get("B200")
    assert isinstance(unknown.value, SitesError)
    assert isinstance(unknown.value, KeyError)  # callers that look a model up catch KeyError
    assert isinstance(unknown.value, ValueError)
    assert str(unknown.value).startswith("unknown device model 'B200'")

    # a cpu entry declared as a device: a bad value, so a ValueError like the rest
    with pytest.raises(ValueError, match="cpu entry") as cpu:
        normalize(devices={"CPU": 8}, cpu_cores=0, mem_gb=0, storage_tb=0, catalog=catalog)
    assert type(cpu.value) is CatalogError
    assert isinstance(cpu.value, SitesError)


def test_latency_config_error_is_a_sites_error_and_still_a_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "rtt.csv"
    bad.write_text("from,a,b\na,0,x\n")
    with pytest.raises(LatencyConfigError) as row:
        load_matrix_csv(bad)
    assert isinstance(row.value, SitesError)
    assert isinstance(row.value, ValueError)
    assert row.value.path == str(bad) and row.value.line == 2

    with pytest.raises(SitesError, match="not a directory"):
        LatencyModel.from_dir(tmp_path / "missing")


def _sites_error_classes() -> set[type[BaseException]]:
    for info in pkgutil.walk_packages(sites.__path__, prefix="sites."):
        importlib.import_module(info.name)
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [SitesError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("sites.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_every_sites_error_is_drawn_in_the_tree() -> None:
    tree = sites.model.errors.__doc__ or ""
    classes = _sites_error_classes()
    assert {CatalogError, InvalidCatalog, UnknownDevice, LatencyConfigError} <= classes
    missing = sorted(c.__name__ for c in classes if c.__name__ not in tree)
    assert not missing, f"not drawn in sites/model/errors.py's docstring: {missing}"


def test_the_tree_draws_only_classes_that_exist() -> None:
    names = {c.__name__ for c in _sites_error_classes()}
    drawn = {
        line.split("── ", 1)[1].split()[0]
        for line in (sites.model.errors.__doc__ or "").splitlines()
        if "── " in line
    }
    assert drawn and drawn <= names, f"drawn but not defined: {sorted(drawn - names)}"
