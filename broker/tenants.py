"""Tenant quotas from configs/tenants.yaml: `tenants: {NAME: {gpus: N}}`; absent = unlimited."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sites.config import read_yaml, validation_problems
from sites.errors import ConfigError


class Quota(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int = Field(ge=0, description="accelerators the tenant may hold at once")


class TenantsFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tenants: dict[str, Quota] = Field(default_factory=dict)


def load_quotas(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    data = read_yaml(path) or {}
    try:
        parsed = TenantsFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(str(path), exc)) from None
    return {name: quota.gpus for name, quota in parsed.tenants.items()}
