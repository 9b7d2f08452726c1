"""Device catalog, normalization and the demo federation configs (no etcd needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sites.model.capacity import Capacity, normalize, normalize_inventory
from sites.model.catalog import (
    CatalogError,
    DeviceCatalog,
    DeviceKind,
    InvalidCatalog,
    UnknownDevice,
    default_path,
)
from sites.model.spec import SiteSpec

ROOT = Path(__file__).resolve().parents[3]
SITES_DIR = ROOT / "configs" / "sites"
SITE_FILES = sorted(SITES_DIR.glob("*.yaml"))
REQUIRED_MODELS = ("H100", "H200", "H20", "A100-80GB", "L40S", "Ascend-910B", "MI300X")
HUB_IDS = {
    "zhangjiakou",
    "yrd-demo-zone",
    "wuhu",
    "shaoguan",
    "tianfu",
    "chongqing",
    "guian",
    "horinger",
    "qingyang",
    "zhongwei",
}


@pytest.fixture(scope="module")
def catalog() -> DeviceCatalog:
    return DeviceCatalog.load(ROOT / "configs" / "devices.yaml")


def _entry(**overrides: object) -> dict[str, object]:
    entry: dict[str, object] = {
        "description": "test GPU",
        "vendor": "nvidia",
        "kind": "gpu",
        "fp64_tflops": 10,
        "fp32_tflops": 20,
        "fp16_tflops": 100,
        "int8_tops": 200,
        "mem_gb": 40,
        "mem_bw_gbps": 1000,
        "power_w": 300,
        "nvml_names": ["TEST"],
        "basis": "datasheet",
        "sources": ["test"],
    }
    entry.update(overrides)
    return entry


def _cpu_entry() -> dict[str, object]:
    return _entry(
        description="test core",
        vendor="intel",
        kind="cpu",
        mem_gb=None,
        nvml_names=[],
        fp64_tflops=0.05,
        basis="derived",
    )


def _write_catalog(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


# --- the shipped catalog ------------------------------------------------------------------------


def test_default_path_is_repository_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CPN_CONFIG_DIR", raising=False)
    assert default_path() == ROOT / "configs" / "devices.yaml"
    assert DeviceCatalog.default_path() == default_path()
    assert DeviceCatalog.load().devices.keys() >= set(REQUIRED_MODELS)


def test_default_path_honours_config_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CPN_CONFIG_DIR", str(tmp_path))
    assert default_path() == tmp_path / "devices.yaml"
    with pytest.raises(InvalidCatalog, match="cannot read"):
        DeviceCatalog.load()


@pytest.mark.parametrize("model", REQUIRED_MODELS)
def test_required_models_have_positive_figures(catalog: DeviceCatalog, model: str) -> None:
    spec = catalog.get(model)
    assert spec.kind in (DeviceKind.gpu, DeviceKind.npu)
    assert spec.fp16_tflops is not None and spec.fp16_tflops > 0
    assert spec.mem_gb is not None and spec.mem_gb > 0
    assert spec.power_w is not None and spec.power_w > 0
    assert spec.sources


def test_press_figures_are_marked(catalog: DeviceCatalog) -> None:
    assert catalog.get("H20").basis == "press"
    assert catalog.get("Ascend-910B").basis == "press"
    assert catalog.get("Ascend-910B").fp64_tflops is None  # unpublished stays null


def test_cpu_reference_is_per_core(catalog: DeviceCatalog) -> None:
    cpu = catalog.cpu
    assert cpu.kind is DeviceKind.cpu
    assert cpu.fp64_tflops == pytest.approx(2.0 * 32 / 1000)  # 2.0 GHz x 32 FLOP/cycle
    assert cpu.power_w == pytest.approx(350 / 56)


def test_contains(catalog: DeviceCatalog) -> None:
    assert "H100" in catalog
    assert "T4" not in catalog
    assert 42 not in catalog


@pytest.mark.parametrize(
    ("nvml_name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla T4", None),
        ("NVIDIA H100 PCIe", None),  # different figures from the SXM part
        ("NVIDIA A100 80GB PCIe", None),
    ],
)
def test_match_nvml(catalog: DeviceCatalog, nvml_name: str, model: str | None) -> None:
    assert catalog.match_nvml(nvml_name) == model


# --- normalization ------------------------------------------------------------------------------


def test_normalize_sums_exactly(catalog: DeviceCatalog) -> None:
    capacity = normalize(
        devices={"H100": 8, "L40S": 2, "Ascend-910B": 4},
        cpu_cores=112,
        mem_gb=2048,
        storage_tb=30,
        catalog=catalog,
    )
    assert capacity.devices == {"H100": 8, "L40S": 2, "Ascend-910B": 4}
    # H100 67, L40S null (0), Ascend null (0)
    assert capacity.fp64_tflops == 536.0
    # 8 x 67 + 2 x 91.6 + 4 x null
    assert capacity.fp32_tflops == 719.2
    # 8 x 989.5 + 2 x 362.05 + 4 x 320
    assert capacity.fp16_tflops == 9920.1
    # 8 x 1979 + 2 x 733 + 4 x 640
    assert capacity.int8_tops == 19858.0
    # 8 x 80 + 2 x 48 + 4 x 64
    assert capacity.accel_mem_gb == 992.0
    assert capacity.cpu_cores == 112
    assert capacity.cpu_fp64_tflops == 7.168  # 112 x 0.064
    assert capacity.mem_gb == 2048.0
    assert capacity.storage_tb == 30.0


def test_normalize_does_not_mutate_input(catalog: DeviceCatalog) -> None:
    devices = {"H20": 16}
    normalize(devices=devices, cpu_cores=0, mem_gb=0, storage_tb=0, catalog=catalog)
    assert devices == {"H20": 16}


def test_normalize_unknown_model_names_it(catalog: DeviceCatalog) -> None:
    with pytest.raises(UnknownDevice) as info:
        normalize(devices={"H10": 8}, cpu_cores=0, mem_gb=0, storage_tb=0, catalog=catalog)
    assert info.value.model == "H10"
    assert "'H10'" in str(info.value)
    assert "did you mean 'H100'" in str(info.value)
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, CatalogError)


def test_get_unknown_raises_keyerror(catalog: DeviceCatalog) -> None:
    with pytest.raises(KeyError, match="unknown device model 'B200'"):
        catalog.get("B200")


def test_normalize_rejects_cpu_entry_and_negatives(catalog: DeviceCatalog) -> None:
    with pytest.raises(CatalogError, match="cpu entry"):
        normalize(devices={"CPU": 8}, cpu_cores=0, mem_gb=0, storage_tb=0, catalog=catalog)
    with pytest.raises(ValueError, match="H100"):
        normalize(devices={"H100": -1}, cpu_cores=0, mem_gb=0, storage_tb=0, catalog=catalog)
    with pytest.raises(ValueError, match="cpu_cores"):
        normalize(devices={}, cpu_cores=-1, mem_gb=0, storage_tb=0, catalog=catalog)


def test_capacity_minus_clamps_at_zero(catalog: DeviceCatalog) -> None:
    total = normalize(
        devices={"H100": 8, "H20": 8}, cpu_cores=112, mem_gb=2048, storage_tb=30, catalog=catalog
    )
    used = normalize(
        devices={"H100": 10, "A100-80GB": 1},
        cpu_cores=16,
        mem_gb=4096,
        storage_tb=1.5,
        catalog=catalog,
    )
    left = total.minus(used)
    assert left.devices == {"H100": 0, "H20": 8}
    assert left.fp16_tflops == 0.0  # 8 x 989.5 + 8 x 148 - (10 x 989.5 + 312) < 0
    assert left.cpu_cores == 96
    assert left.mem_gb == 0.0
    assert left.storage_tb == 28.5
    assert total.minus(Capacity.zero()) == total


def test_capacity_zero() -> None:
    zero = Capacity.zero()
    assert zero.devices == {}
    assert zero.fp16_tflops == 0.0
    assert zero.cpu_cores == 0


# --- bad catalog files --------------------------------------------------------------------------


def test_bad_catalog_names_field_path(tmp_path: Path) -> None:
    path = _write_catalog(
        tmp_path, {"devices": {"X1": _entry(fp16_tflops=-5), "CPU": _cpu_entry()}}
    )
    with pytest.raises(CatalogError) as info:
        DeviceCatalog.load(path)
    assert isinstance(info.value, InvalidCatalog)
    assert info.value.field == "devices.X1.fp16_tflops"
    assert info.value.path == path
    assert str(path) in str(info.value)
    assert "devices.X1.fp16_tflops" in str(info.value)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (
            {"devices": {"X1": _entry(fp16_tflops="100"), "CPU": _cpu_entry()}},
            "devices.X1.fp16_tflops",
        ),
        ({"devices": {"X1": _entry(colour="red"), "CPU": _cpu_entry()}}, "devices.X1.colour"),
        ({"devices": {"X1": _entry(mem_gb=None), "CPU": _cpu_entry()}}, "devices.X1"),
        ({"devices": {"X1": _entry(kind="tpu"), "CPU": _cpu_entry()}}, "devices.X1.kind"),
        ({"devices": {"X1": _entry()}}, "cpu_reference"),
        (
            {"devices": {"X1": _entry(), "CPU": _cpu_entry()}, "cpu_reference": "X1"},
            "cpu_reference",
        ),
        ({"devices": {"X1": _entry(), "X2": _entry(), "CPU": _cpu_entry()}}, "devices"),
        ({"devices": {"bad name": _entry(), "CPU": _cpu_entry()}}, "devices"),
        ({"devices": {}}, "devices"),
        ({"device": {}}, "devices"),
    ],
)
def test_invalid_catalogs(tmp_path: Path, data: object, field: str) -> None:
    with pytest.raises(InvalidCatalog) as info:
        DeviceCatalog.load(_write_catalog(tmp_path, data))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- just\n- a list\n", "mapping"),
        ("devices: {a: 1\n", "not valid YAML"),
        ("devices: {}\ndevices: {}\n", "duplicate key 'devices'"),
    ],
)
def test_unparseable_catalogs(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "devices.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidCatalog, match=message) as info:
        DeviceCatalog.load(path)
    assert info.value.field is None


# --- the demo federation ------------------------------------------------------------------------


def _load_site(path: Path) -> SiteSpec:
    return SiteSpec.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))


@pytest.mark.parametrize("path", SITE_FILES, ids=lambda p: p.stem)
def test_site_config_is_valid(catalog: DeviceCatalog, path: Path) -> None:
    assert path.read_text(encoding="utf-8").startswith("#"), "comment block with sources first"
    site = _load_site(path)
    assert site.id == path.stem
    models = [pool.model for pool in site.inventory.devices]
    assert models, "every demo site has accelerators"
    for model in models:
        assert model in catalog
        assert catalog.get(model).kind is not DeviceKind.cpu
        assert model in site.prices.usd_per_gpu_hour, f"{site.id}: no price for {model}"
    assert set(site.prices.usd_per_gpu_hour) <= set(models)
    capacity = normalize_inventory(site.inventory, catalog)
    assert capacity.fp16_tflops > 0
    assert site.agent == SiteSpec.model_fields["agent"].default


def test_demo_federation_shape() -> None:
    sites = {path.stem: _load_site(path) for path in SITE_FILES}
    assert HUB_IDS <= sites.keys()
    for hub_id in HUB_IDS:
        site = sites[hub_id]
        assert site.country == "CN"
        assert site.labels["side"] in ("east", "west")
        assert site.labels["hub"] == site.region
    foreign = [s for s in sites.values() if s.country != "CN"]
    assert len(foreign) >= 2
    assert {s.latency_zone for s in foreign} >= {"frankfurt", "tokyo", "dallas"}

    endpoints = [(s.id, svc) for s in sites.values() for svc in s.services]
    ports = [svc.url.rsplit(":", 1)[1] for _, svc in endpoints]
    assert len(ports) == len(set(ports)), "one port per (site, service)"
    assert all(18100 <= int(port) <= 18199 for port in ports)
    hosts: dict[str, set[str]] = {}
    for site_id, svc in endpoints:
        hosts.setdefault(svc.name, set()).add(site_id)
    assert 4 <= len(hosts) <= 6
    assert all(2 <= len(ids) <= 4 for ids in hosts.values())


def test_latency_matrix_zones_cover_foreign_sites() -> None:
    lines = (ROOT / "configs" / "latency" / "ibm-cloud-vpc-2024.csv").read_text().splitlines()
    header = next(line for line in lines if not line.startswith("#"))
    zones = set(header.split(",")[1:])
    for path in SITE_FILES:
        site = _load_site(path)
        if site.latency_zone is not None:
            assert site.latency_zone in zones
