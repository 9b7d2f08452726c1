"""Fixtures for the simulator tests: small configs directories and scenario files."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import site_doc

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def make_configs(tmp_path: Path) -> Callable[..., Path]:
    """A configs directory with the repository's catalog, regions, clients and standin files and
    the given sites (id -> site_doc overrides); tenants: quotas."""

    def make(
        sites: dict[str, dict[str, Any]],
        *,
        quotas: dict[str, int] | None = None,
        clients: bool = False,
    ) -> Path:
        root = tmp_path / "configs"
        (root / "sites").mkdir(parents=True, exist_ok=True)
        for name in ("devices.yaml", "regions.yaml", "standin.yaml"):
            shutil.copy(REPO / "configs" / name, root / name)
        shutil.copytree(REPO / "configs" / "latency", root / "latency", dirs_exist_ok=True)
        for site_id, overrides in sites.items():
            doc = site_doc(site_id, **overrides)
            doc.pop("agent", None)
            (root / "sites" / f"{site_id}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        if quotas:
            tenants = {"tenants": {t: {"gpus": q} for t, q in quotas.items()}}
            (root / "tenants.yaml").write_text(yaml.safe_dump(tenants))
        if clients:
            shutil.copy(REPO / "configs" / "clients.yaml", root / "clients.yaml")
        return root

    return make


@pytest.fixture
def write_scenario(tmp_path: Path) -> Callable[..., Path]:
    def write(doc: dict[str, Any], name: str = "scenario.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return write
