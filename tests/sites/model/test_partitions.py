"""Fractional accelerators: MIG profiles in the catalog, slice pseudo-models, a site's partitions
(legality against NVIDIA's placement rules, the expanded pools, slot ids). No etcd needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from sites.model.capacity import normalize_inventory
from sites.model.catalog import (
    SLICE_SEP,
    DeviceCatalog,
    DeviceSpec,
    InvalidCatalog,
    InvalidPartition,
    MigSpec,
    UnknownDevice,
    check_partitions,
    device_slots,
    expand,
    mig_model,
    partition_problems,
    shared_model,
    split_model,
)
from sites.model.spec import DevicePool, Inventory, Partitioning, SiteSpec
from tests.conftest import CONFIGS, site_doc


@pytest.fixture(scope="module")
def catalog() -> DeviceCatalog:
    return DeviceCatalog.load(CONFIGS / "devices.yaml")


def inventory(*pools: dict[str, Any]) -> Inventory:
    return Inventory.model_validate({"devices": list(pools), "cpu_cores": 64, "mem_gb": 512})


# --- the catalog's MIG profiles ---------------------------------------------------------------


def test_mig_profiles_load(catalog: DeviceCatalog) -> None:
    a100 = catalog.get("A100-80GB").mig
    assert a100 is not None and (a100.compute_slices, a100.memory_slices) == (7, 8)
    assert list(a100.profiles) == [
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    ]
    p = a100.profiles["3g.40gb"]
    assert (p.compute_slices, p.memory_slices, p.mem_gb, p.max_instances, p.starts) == (
        3,
        4,
        40,
        2,
        (0, 4),
    )
    h100 = catalog.get("H100").mig
    assert h100 is not None and list(h100.profiles) == list(a100.profiles)
    h200 = catalog.get("H200").mig
    assert h200 is not None
    assert set(h200.profiles) >= {"1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"}
    assert h200.profiles["7g.141gb"].mem_gb == 141
    assert catalog.get("H20").mig is None and catalog.get("L40S").mig is None
    for model in ("A100-80GB", "H100", "H200"):
        assert any("Multi-Instance GPU User Guide" in s for s in catalog.get(model).sources)


def _catalog_with(tmp_path: Path, mig: dict[str, Any], kind: str = "gpu") -> Path:
    path = tmp_path / "devices.yaml"
    path.write_text(
        "devices:\n"
        "  G:\n"
        "    {description: g, vendor: nvidia, kind: " + kind + ", fp64_tflops: 1, fp32_tflops: 1,\n"
        "     fp16_tflops: 7, int8_tops: 14, mem_gb: 80, mem_bw_gbps: 800, power_w: 700,\n"
        "     basis: datasheet, sources: [x], mig: " + repr(mig).replace("'", '"') + "}\n"
        "  CPU:\n"
        "    {description: c, vendor: intel, kind: cpu, fp64_tflops: 0.1, fp32_tflops: 0.1,\n"
        "     fp16_tflops: 1, int8_tops: 1, mem_gb: null, mem_bw_gbps: 1, power_w: 1,\n"
        "     basis: derived, sources: [x]}\n"
    )
    return path


@pytest.mark.parametrize(
    ("profile", "field_part", "reason"),
    [
        (
            {
                "compute_slices": 3,
                "memory_slices": 4,
                "mem_gb": 40,
                "max_instances": 2,
                "starts": [5],
            },
            "mig",
            "runs past",
        ),
        (
            {
                "compute_slices": 1,
                "memory_slices": 1,
                "mem_gb": 10,
                "max_instances": 1,
                "starts": [2, 1],
            },
            "starts",
            "ascending",
        ),
        (
            {
                "compute_slices": 1,
                "memory_slices": 1,
                "mem_gb": 90,
                "max_instances": 1,
                "starts": [0],
            },
            "devices.G",
            "more memory than the device",
        ),
    ],
)
def test_a_bad_mig_profile_names_its_field(
    tmp_path: Path, profile: dict[str, Any], field_part: str, reason: str
) -> None:
    mig = {"compute_slices": 7, "memory_slices": 8, "profiles": {"3g.40gb": profile}}
    with pytest.raises(InvalidCatalog) as bad:
        DeviceCatalog.load(_catalog_with(tmp_path, mig))
    assert bad.value.field is not None and field_part in bad.value.field
    assert reason in bad.value.message


# --- pseudo-models ------------------------------------------------------------------------------


def test_model_names() -> None:
    assert SLICE_SEP == "/"
    assert mig_model("A100-80GB", "3g.40gb") == "A100-80GB/3g.40gb"
    assert shared_model("A100-80GB", 4) == "A100-80GB/ts4"
    assert split_model("A100-80GB/3g.40gb") == ("A100-80GB", "3g.40gb")
    assert split_model("H100/ts4") == ("H100", "ts4")
    assert split_model("H100") == ("H100", None)


def test_mig_pseudo_model(catalog: DeviceCatalog) -> None:
    base = catalog.get("A100-80GB")
    spec = catalog.get("A100-80GB/3g.40gb")
    assert catalog.fraction("A100-80GB/3g.40gb") == pytest.approx(3 / 7)
    assert spec.mem_gb == 40
    assert spec.fp16_tflops == pytest.approx(312 * 3 / 7, abs=1e-5)
    assert spec.power_w == pytest.approx(400 * 3 / 7, abs=1e-5)
    assert spec.mem_bw_gbps == pytest.approx(2039 / 2)  # 4 of 8 memory slices
    assert "MIG 3g.40gb" in spec.description and base.description in spec.description
    assert spec.kind is base.kind and spec.basis == "derived" and spec.mig is None
    assert spec.nvml_names == ()
    assert catalog.get("A100-80GB/3g.40gb") is spec  # cached
    assert catalog.fraction("H200/7g.141gb") == 1.0
    assert catalog.get("H200/1g.18gb").mem_gb == 18


def test_time_sliced_pseudo_model(catalog: DeviceCatalog) -> None:
    spec = catalog.get("A100-80GB/ts4")
    assert catalog.fraction("A100-80GB/ts4") == 0.25
    assert spec.mem_gb == 20 and spec.fp16_tflops == 78 and spec.power_w == 100
    assert "1/4 time-sliced" in spec.description
    # any accelerator can be time-sliced, MIG or not
    assert catalog.get("L40S/ts2").mem_gb == 24
    assert catalog.fraction("Ascend-910B/ts16") == 1 / 16


def test_whole_models(catalog: DeviceCatalog) -> None:
    assert catalog.fraction("H100") == 1.0
    assert "H100" in catalog and "A100-80GB/3g.40gb" in catalog and "H100/ts16" in catalog
    assert all(SLICE_SEP not in m for m in catalog.models)
    catalog.get("H100/ts2")
    assert all(SLICE_SEP not in m for m in catalog.models)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("A100-80GB/5g.50gb", "A100-80GB has no MIG profile '5g.50gb' (its profiles: 1g.10gb,"),
        ("A100-80GB/1g.18gb", "7g.80gb"),
        ("H20/1g.10gb", "H20 has no MIG profiles"),
        ("H100/ts1", "N from 2 to 16"),
        ("H100/ts17", "N from 2 to 16"),
        ("CPU/ts2", "cpu entry"),
        ("Nope/ts2", "unknown device model"),
        ("H100/", "no MIG profile ''"),
    ],
)
def test_unknown_slices(catalog: DeviceCatalog, name: str, says: str) -> None:
    assert name not in catalog
    with pytest.raises(UnknownDevice) as unknown:
        catalog.get(name)
    assert says in str(unknown.value)
    with pytest.raises(UnknownDevice):
        catalog.fraction(name)


def test_caches_do_not_change_equality(catalog: DeviceCatalog) -> None:
    fresh = DeviceCatalog.load(CONFIGS / "devices.yaml")
    catalog.get("H100/ts8")
    assert fresh == catalog


# --- the site's declaration ---------------------------------------------------------------------


def test_partitioning_model() -> None:
    assert Partitioning(devices=2, time_slices=4).mig is None
    pool = DevicePool.model_validate(
        {
            "model": "A100-80GB",
            "count": 8,
            "partitions": [{"devices": 2, "mig": {"3g.40gb": 2}}, {"devices": 3, "time_slices": 4}],
        }
    )
    assert pool.whole == 3


@pytest.mark.parametrize(
    ("pool", "loc", "reason"),
    [
        ({"partitions": [{"devices": 5, "time_slices": 2}, {"devices": 4, "time_slices": 2}]},
         ("partitions",), "partitions cover 9 devices, the pool has 8"),
        ({"partitions": [{"devices": 1}]}, ("partitions", 0, "time_slices"), "give mig"),
        ({"partitions": [{"devices": 1, "mig": {"1g.10gb": 1}, "time_slices": 2}]},
         ("partitions", 0, "time_slices"), "not both"),
        ({"partitions": [{"devices": 1, "mig": {}}]}, ("partitions", 0, "mig"), "at least one"),
        ({"partitions": [{"devices": 1, "mig": {"1g.10gb": 0}}]},
         ("partitions", 0, "mig", "1g.10gb"), "greater than or equal to 1"),
        ({"partitions": [{"devices": 0, "time_slices": 2}]}, ("partitions", 0, "devices"),
         "greater than or equal to 1"),
        ({"partitions": [{"devices": 1, "time_slices": 17}]},
         ("partitions", 0, "time_slices"), "less than or equal to 16"),
        ({"partitions": [{"devices": 1, "mig": {"ts4": 1}}]}, ("partitions", 0, "mig"),
         "not a MIG profile name"),
        ({"model": "A100-80GB/3g.40gb"}, ("model",), "declare MIG instances or time slices"),
    ],
)  # fmt: skip
def test_bad_partitions_name_their_field(
    pool: dict[str, Any], loc: tuple[str | int, ...], reason: str
) -> None:
    doc = {"model": "A100-80GB", "count": 8, **pool}
    with pytest.raises(ValidationError) as bad:
        DevicePool.model_validate(doc)
    (error,) = bad.value.errors()
    assert error["loc"] == loc
    assert reason in error["msg"]


# --- legality against the hardware --------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("A100-80GB", {"1g.10gb": 7}),
        ("A100-80GB", {"7g.80gb": 1}),
        ("A100-80GB", {"4g.40gb": 1, "3g.40gb": 1}),
        ("A100-80GB", {"3g.40gb": 2}),
        ("A100-80GB", {"2g.20gb": 2, "3g.40gb": 1}),  # 2g at 0 and 2, 3g at 4
        ("A100-80GB", {"2g.20gb": 3, "1g.10gb": 1}),  # 2g at 0, 2, 4, 1g at 6
        ("A100-80GB", {"3g.40gb": 1, "1g.10gb": 4}),  # only with 3g at 4: backtracking
        ("A100-80GB", {"1g.20gb": 3, "1g.10gb": 2}),  # a 1g.20gb must leave 4-5 to the 1g.10gb
        ("A100-80GB", {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}),
        ("A100-80GB", {"1g.10gb+me": 1, "1g.10gb": 6}),
        ("H100", {"1g.20gb": 4}),
        ("H200", {"3g.71gb": 1, "2g.35gb": 1, "1g.18gb": 2}),
    ],
)
def test_legal_layouts(catalog: DeviceCatalog, model: str, layout: dict[str, int]) -> None:
    assert catalog.mig_fit(model, layout) is None
    inv = inventory({"model": model, "count": 2, "partitions": [{"devices": 1, "mig": layout}]})
    check_partitions(inv, catalog)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"3g.40gb": 3}, "3g.40gb x 3 does not fit one A100-80GB: 9 of 7 compute slices"),
        ({"4g.40gb": 2}, "4g.40gb x 2 does not fit one A100-80GB: 8 of 7 compute slices"),
        ({"2g.20gb": 3, "3g.40gb": 1}, "2g.20gb x 3 + 3g.40gb x 1 does not fit one A100-80GB: "
         "9 of 7 compute slices"),
        # 2 x 3g.40gb take all 8 memory slices (4/8 each, the guide's table): no room for a 1g
        ({"3g.40gb": 2, "1g.10gb": 1}, "3g.40gb x 2 + 1g.10gb x 1 does not fit one A100-80GB: "
         "9 of 8 memory slices"),
        ({"1g.20gb": 4, "1g.10gb": 1}, "9 of 8 memory slices"),
        ({"1g.10gb": 8}, "8 of 7 compute slices"),
        ({"1g.10gb+me": 2}, "1g.10gb+me x 2 does not fit one A100-80GB: at most 1 1g.10gb+me on "
         "one device"),
        ({"3g.71gb": 1}, "A100-80GB has no MIG profile '3g.71gb' (its profiles: 1g.10gb,"),
    ],
)  # fmt: skip
def test_illegal_layouts_name_field_and_reason(
    catalog: DeviceCatalog, layout: dict[str, int], message: str
) -> None:
    inv = inventory(
        {"model": "H100", "count": 1},
        {
            "model": "A100-80GB",
            "count": 4,
            "partitions": [{"devices": 1, "time_slices": 4}, {"devices": 2, "mig": layout}],
        },
    )
    with pytest.raises(InvalidPartition) as bad:
        check_partitions(inv, catalog)
    assert bad.value.field == "inventory.devices[1].partitions[1].mig"
    assert message in bad.value.message
    assert str(bad.value).startswith("inventory.devices[1].partitions[1].mig: ")
    # every place that validates a site against the catalog refuses it
    with pytest.raises(InvalidPartition):
        normalize_inventory(inv, catalog)
    with pytest.raises(InvalidPartition):
        expand(inv, catalog)


def test_mig_on_a_model_without_profiles(catalog: DeviceCatalog) -> None:
    inv = inventory(
        {"model": "H20", "count": 2, "partitions": [{"devices": 1, "mig": {"1g.12gb": 7}}]}
    )
    (problem,) = partition_problems(inv, catalog)
    assert problem.field == "inventory.devices[0].partitions[0].mig"
    assert "H20 has no MIG profiles in the catalog" in problem.message


def test_every_problem_is_listed(catalog: DeviceCatalog) -> None:
    inv = inventory(
        {"model": "A100-80GB", "count": 3, "partitions": [
            {"devices": 1, "mig": {"4g.40gb": 2}},
            {"devices": 1, "mig": {"1g.10gb": 7}},
            {"devices": 1, "mig": {"9g.90gb": 1}},
        ]},
        {"model": "Unknown-GPU", "count": 1, "partitions": [{"devices": 1, "mig": {"1g.1gb": 1}}]},
    )  # fmt: skip
    fields = [p.field for p in partition_problems(inv, catalog)]
    # the unknown model is reported on its own (UnknownDevice, sites.model.config), not here
    assert fields == [
        "inventory.devices[0].partitions[0].mig",
        "inventory.devices[0].partitions[2].mig",
    ]


def test_placement_only_failure(tmp_path: Path) -> None:
    """A made-up device whose 2-slice profile may start only at 1: two of them fit by the sums
    (4 of 4 slices) but not by the placement rules; one fits beside 1-slice instances at 0, 3."""
    mig = {
        "compute_slices": 4,
        "memory_slices": 4,
        "profiles": {
            "2g.40gb": {"compute_slices": 2, "memory_slices": 2, "mem_gb": 40,
                        "max_instances": 2, "starts": [1]},
            "1g.20gb": {"compute_slices": 1, "memory_slices": 1, "mem_gb": 20,
                        "max_instances": 4, "starts": [0, 1, 2, 3]},
        },
    }  # fmt: skip
    catalog = DeviceCatalog.load(_catalog_with(tmp_path, mig))
    why = catalog.mig_fit("G", {"2g.40gb": 2})
    assert why is not None and "no non-overlapping allowed start slices" in why
    assert catalog.mig_fit("G", {"2g.40gb": 1, "1g.20gb": 2}) is None
    assert catalog.mig_fit("G", {"2g.40gb": 1, "1g.20gb": 3}) is not None


def test_a_mig_spec_must_fit_its_slices() -> None:
    with pytest.raises(ValidationError, match="runs past"):
        MigSpec.model_validate(
            {
                "compute_slices": 7,
                "memory_slices": 8,
                "profiles": {
                    "7g.80gb": {"compute_slices": 7, "memory_slices": 8, "mem_gb": 80,
                                "max_instances": 1, "starts": [1]},
                },
            }
        )  # fmt: skip
    with pytest.raises(ValidationError, match="only a gpu"):
        DeviceSpec.model_validate(
            {"description": "n", "vendor": "huawei", "kind": "npu", "fp64_tflops": None,
             "fp32_tflops": None, "fp16_tflops": 1, "int8_tops": 1, "mem_gb": 64,
             "mem_bw_gbps": 1, "power_w": 1, "basis": "press", "sources": ["x"],
             "mig": {"compute_slices": 1, "memory_slices": 1, "profiles": {
                 "1g.64gb": {"compute_slices": 1, "memory_slices": 1, "mem_gb": 64,
                             "max_instances": 1, "starts": [0]}}}}
        )  # fmt: skip


# --- what placement sees ------------------------------------------------------------------------


MIXED = {
    "model": "A100-80GB",
    "count": 8,
    "partitions": [
        {"devices": 2, "mig": {"3g.40gb": 1, "2g.20gb": 2}},
        {"devices": 1, "mig": {"3g.40gb": 2}},
        {"devices": 2, "time_slices": 4},
    ],
}


def test_expand(catalog: DeviceCatalog) -> None:
    inv = inventory(MIXED, {"model": "H100", "count": 4})
    assert expand(inv, catalog) == {
        "A100-80GB": 3,
        "A100-80GB/3g.40gb": 2 * 1 + 1 * 2,
        "A100-80GB/2g.20gb": 2 * 2,
        "A100-80GB/ts4": 2 * 4,
        "H100": 4,
    }
    every = inventory(
        {"model": "H200", "count": 2, "partitions": [{"devices": 2, "time_slices": 2}]}
    )
    assert expand(every, catalog) == {"H200/ts2": 4}  # no whole H200 left: omitted


def test_device_slots(catalog: DeviceCatalog) -> None:
    pool = DevicePool.model_validate(MIXED)
    slots = device_slots(pool, catalog)
    assert slots["A100-80GB/3g.40gb"] == (
        (0, "0:3g.40gb:0"),
        (1, "1:3g.40gb:0"),
        (2, "2:3g.40gb:0"),
        (2, "2:3g.40gb:1"),
    )
    assert slots["A100-80GB/2g.20gb"] == (
        (0, "0:2g.20gb:0"),
        (0, "0:2g.20gb:1"),
        (1, "1:2g.20gb:0"),
        (1, "1:2g.20gb:1"),
    )
    assert slots["A100-80GB/ts4"] == tuple((d, f"{d}:ts:{k}") for d in (3, 4) for k in range(4))
    assert slots["A100-80GB"] == ((5, ""), (6, ""), (7, ""))
    # the same counts as expand(), and stable
    assert {m: len(s) for m, s in slots.items()} == expand(inventory(MIXED), catalog)
    assert device_slots(DevicePool.model_validate(MIXED), catalog) == slots
    assert device_slots(DevicePool(model="H100", count=2), catalog) == {"H100": ((0, ""), (1, ""))}


def test_device_slots_refuse_an_illegal_layout(catalog: DeviceCatalog) -> None:
    pool = DevicePool.model_validate(
        {"model": "A100-80GB", "count": 1, "partitions": [{"devices": 1, "mig": {"7g.80gb": 2}}]}
    )
    with pytest.raises(InvalidPartition) as bad:
        device_slots(pool, catalog)
    assert bad.value.field == "partitions[0].mig"


def test_capacity_counts_each_physical_device_once(catalog: DeviceCatalog) -> None:
    plain = inventory({"model": "A100-80GB", "count": 8}, {"model": "H100", "count": 4})
    cut = inventory(MIXED, {"model": "H100", "count": 4})
    assert normalize_inventory(cut, catalog) == normalize_inventory(plain, catalog)
    assert normalize_inventory(cut, catalog).devices == {"A100-80GB": 8, "H100": 4}


def test_a_site_file_declares_partitions(catalog: DeviceCatalog) -> None:
    doc = site_doc("mig-site")
    doc["inventory"]["devices"] = [
        {"model": "H100", "count": 16, "partitions": [{"devices": 4, "mig": {"1g.10gb": 7}}]}
    ]
    spec = SiteSpec.model_validate(doc)
    assert SiteSpec.model_validate_json(spec.model_dump_json()) == spec  # the registry value
    assert expand(spec.inventory, catalog) == {"H100": 12, "H100/1g.10gb": 28}
