"""A tenant's `inference` section and a token's own limits (broker.model.tenants): what they
accept, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from broker.model.tenants import InferencePolicy, TenantPolicy, TokenLimits, load_tenancy
from broker.state.auth import Role, TokenRecord, new_token
from sites.model.errors import ConfigError
from tests.conftest import CONFIGS


def test_the_demo_file_sets_inference_limits() -> None:
    startup = load_tenancy(CONFIGS / "tenants.yaml").tenants["startup"]
    assert startup.inference == InferencePolicy(
        requests_per_minute=6000,
        tokens_per_minute=2_000_000,
        budget={"usd_per_month": 5000},
    )
    assert startup.inference.limited


def test_absent_is_not_limited() -> None:
    policy = TenantPolicy.model_validate({"quota": {"gpus": 1}})
    assert policy.inference is None
    assert not InferencePolicy(priority=-5).limited
    assert not InferencePolicy(budget={}).limited
    assert InferencePolicy(budget={"tokens_per_month": 1}).limited


@pytest.mark.parametrize(
    ("inference", "field"),
    [
        ({"tokens_per_minute": 0}, "tenants.ai-lab.inference.tokens_per_minute"),
        ({"requests_per_minute": "many"}, "tenants.ai-lab.inference.requests_per_minute"),
        ({"budget": {"usd_per_month": -1}}, "tenants.ai-lab.inference.budget.usd_per_month"),
        ({"budget": {"tokens_per_month": 0}}, "tenants.ai-lab.inference.budget.tokens_per_month"),
        ({"budget": {"usd": 5}}, "tenants.ai-lab.inference.budget.usd"),
        ({"priority": 1001}, "tenants.ai-lab.inference.priority"),
        ({"priority": -1001}, "tenants.ai-lab.inference.priority"),
        ({"rpm": 5}, "tenants.ai-lab.inference.rpm"),
    ],
)
def test_a_bad_limit_names_its_field(
    tmp_path: Path, inference: dict[str, object], field: str
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": {"ai-lab": {"inference": inference}}}))
    with pytest.raises(ConfigError) as caught:
        load_tenancy(path)
    assert f"{path}: {field}:" in str(caught.value)


def test_a_token_carries_limits_of_its_own() -> None:
    limits = TokenLimits(requests_per_minute=10, budget={"usd_per_month": 5.0})
    record, token = new_token(
        role=Role.tenant_user, tenant="ai-lab", now=0.0, created_by="t", limits=limits
    )
    assert record.limits == limits
    assert TokenRecord.model_validate_json(record.model_dump_json()).limits == limits
    assert record.public()["limits"] == {
        "requests_per_minute": 10,
        "tokens_per_minute": None,
        "budget": {"usd_per_month": 5.0, "tokens_per_month": None},
    }
    plain, _ = new_token(role=Role.tenant_user, tenant="ai-lab", now=0.0, created_by="t")
    assert plain.limits is None
    # limits that limit nothing are no limits
    empty, _ = new_token(
        role=Role.viewer, tenant=None, now=0.0, created_by="t", limits=TokenLimits()
    )
    assert empty.limits is None
    # a record written before tokens had limits still reads
    old = record.model_dump(mode="json", exclude={"limits"})
    assert TokenRecord.model_validate(old).limits is None
    assert token.startswith("cpn_")
