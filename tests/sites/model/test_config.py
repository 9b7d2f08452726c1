"""Onboarding from config: every invalid case names its field; nothing half-registered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sites.model.catalog import DeviceCatalog
from sites.model.config import load_site, load_sites
from sites.model.errors import ConfigError
from sites.registry.client import Registry
from tests.conftest import CONFIGS, run_cpn, site_doc


@pytest.fixture(scope="module")
def catalog() -> DeviceCatalog:
    return DeviceCatalog.load(CONFIGS / "devices.yaml")


def write(tmp_path: Path, name: str, doc: Any) -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def with_(path: str, value: Any) -> dict[str, Any]:
    """site_doc('bad') with one dotted path set (or removed when value is ...)."""
    doc = site_doc("bad")
    node: Any = doc
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    last = parts[-1]
    if value is ...:
        del node[last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return doc


def svc(**overrides: Any) -> dict[str, Any]:
    return {"name": "s", "model": "m", "url": "http://h:1", "max_concurrency": 1, **overrides}


INVALID = [
    ("id", "Bad_ID", "id"),
    ("region", ..., "region"),
    ("country", "china", "country"),
    ("provider", "digitalocean-ish", "provider"),
    ("coordinates.lat", 123, "coordinates.lat"),
    ("inventory.devices.0.count", 0, "inventory.devices[0].count"),
    ("inventory.devices.0.model", "H900", "inventory.devices[0].model"),
    ("inventory.cpu_cores", -1, "inventory.cpu_cores"),
    ("prices.usd_per_gpu_hour", {}, "prices.usd_per_gpu_hour.H100"),
    ("prices.usd_per_core_hour", -0.1, "prices.usd_per_core_hour"),
    ("power.pue", 0.8, "power.pue"),
    ("services", [svc(url="ftp://x")], "services[0].url"),
    ("services", [svc(max_concurrency=0)], "services[0].max_concurrency"),
    ("services", [svc(), svc()], "services[1].name"),
    ("executor", {"kind": "local", "partition": "gpu"}, "executor.partition"),
    ("agent", {"interval_s": 0}, "agent.interval_s"),
    ("agent", {"refresh_s": -1}, "agent.refresh_s"),
    ("agent", {"refresh_s": 7200}, "agent.refresh_s"),
    ("labels", {"Bad Key": "x"}, "labels"),
    ("surprise", 1, "surprise"),
    ("inventory.devices.0.sharing", "vgpu", "inventory.devices[0].sharing"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "value", "field"), INVALID, ids=[str(i) for i in range(len(INVALID))]
)
def test_invalid_field_is_named(
    tmp_path: Path, catalog: DeviceCatalog, path: str, value: Any, field: str
) -> None:
    file = write(tmp_path, "bad.yaml", with_(path, value))
    with pytest.raises(ConfigError) as info:
        load_site(file, catalog)
    fields = [p.field for p in info.value.problems]
    assert field in fields, fields
    assert all(p.source == str(file) for p in info.value.problems)


@pytest.mark.e2e
def test_every_problem_reported_with_file_field_reason(tmp_path: Path) -> None:
    doc = with_("country", "china")
    doc["power"]["pue"] = 0.5
    bad = write(tmp_path, "bad.yaml", doc)
    good = write(tmp_path, "good.yaml", site_doc("good"))
    result = run_cpn("site", "validate", str(good), str(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert f"cpn: error: {bad}: country: " in lines[0] + lines[1]
    assert any(f"{bad}: power.pue: " in line for line in lines)
    assert len(lines) == 2


def test_malformed_yaml_and_missing_file(tmp_path: Path, catalog: DeviceCatalog) -> None:
    broken = write(tmp_path, "broken.yaml", "id: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML: line"):
        load_site(broken, catalog)
    with pytest.raises(ConfigError, match="cannot read"):
        load_site(tmp_path / "nope.yaml", catalog)
    scalar = write(tmp_path, "scalar.yaml", "just a string\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_site(scalar, catalog)


def test_duplicate_ids_across_files(tmp_path: Path, catalog: DeviceCatalog) -> None:
    a = write(tmp_path, "a.yaml", site_doc("same"))
    b = write(tmp_path, "b.yaml", site_doc("same"))
    with pytest.raises(ConfigError) as info:
        load_sites([a, b], catalog)
    assert info.value.problems[0].field == "id"


@pytest.mark.e2e
def test_demo_federation_validates() -> None:
    files = sorted((CONFIGS / "sites").glob("*.yaml"))
    result = run_cpn("site", "validate", *map(str, files))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok") == len(files) >= 12


@pytest.mark.e2e
async def test_join_is_all_or_nothing(tmp_path: Path, registry: Registry) -> None:
    good = write(tmp_path, "good.yaml", site_doc("good"))
    bad = write(tmp_path, "bad.yaml", with_("inventory.devices.0.model", "H900"))
    result = run_cpn("site", "join", str(good), str(bad), etcd_url=registry.url)
    assert result.returncode == 2
    assert "inventory.devices[0].model" in result.stderr
    assert await registry.get_spec("good") is None
    assert (await registry.snapshot()).specs == {}

    result = run_cpn("site", "join", str(good), etcd_url=registry.url)
    assert result.returncode == 0, result.stderr
    assert "site good joined" in result.stdout
    spec = await registry.get_spec("good")
    assert spec is not None and spec.inventory.devices[0].count == 16
    again = run_cpn("site", "join", str(good), etcd_url=registry.url)
    assert "site good updated" in again.stdout


@pytest.mark.e2e
def test_cli_usage_errors_are_one_line(tmp_path: Path) -> None:
    result = run_cpn("sites", "--etcd", "ftp://x:1")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--etcd" in result.stderr
    result = run_cpn("site", "leave")
    assert result.returncode == 2 and result.stderr.startswith("cpn: error:")


@pytest.mark.e2e
def test_unreachable_etcd_is_one_line_exit_1() -> None:
    result = run_cpn("sites", "--etcd", "http://127.0.0.1:1", timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith("cpn: error: etcd at http://127.0.0.1:1 is unavailable")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("model", "executor", "words"),
    [
        ("MI300X", {}, "MPS is NVIDIA's; MI300X is a amd device: use time-slicing"),
        ("H100", {"kind": "slurm", "partition": "gpu"}, "a Slurm site shares GPUs by Slurm's"),
    ],
)
def test_a_sharing_pool_the_site_cannot_run_is_named(
    tmp_path: Path, catalog: DeviceCatalog, model: str, executor: dict[str, Any], words: str
) -> None:
    doc = site_doc("bad")
    doc["inventory"]["devices"] = [{"model": model, "count": 8, "sharing": "mps"}]
    doc["prices"]["usd_per_gpu_hour"] = {model: 2.0}
    if executor:
        doc["executor"] = executor
    with pytest.raises(ConfigError) as info:
        load_site(write(tmp_path, "bad.yaml", doc), catalog)
    found = {p.field: p.reason for p in info.value.problems}
    assert words in found["inventory.devices[0].sharing"], found
    # time slicing is any vendor's, at a site with the local executor
    doc["inventory"]["devices"][0]["sharing"] = "time-slicing"
    doc.pop("executor", None)
    assert load_site(write(tmp_path, "ok.yaml", doc), catalog).inventory.devices[0].sharing
