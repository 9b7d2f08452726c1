"""Tenant quotas from configs/tenants.yaml: `tenants: {NAME: {gpus: N}}`; absent = unlimited."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from sites.config import read_yaml, validate_mapping


class Quota(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int = Field(ge=0, description="accelerators the tenant may hold at once")


class TenantsFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tenants: dict[str, Quota] = Field(default_factory=dict)


def load_quotas(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    parsed = validate_mapping(str(path), read_yaml(path) or {}, TenantsFile, "with tenants")
    return {name: quota.gpus for name, quota in parsed.tenants.items()}
