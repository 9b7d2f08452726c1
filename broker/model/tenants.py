"""Tenants, cohorts and priority classes: configs/tenants.yaml and `PUT /v1/tenants/NAME`.

One model serves the file, the API body and the registry value (/cpn/v1/tenants/<name>):

    tenants:
      ai-lab:
        weight: 2                    # fair-share weight (default 1)
        cohort: research             # borrows from / lends to the cohort's other members
        quota:                       # nominal quota over the whole federation
          gpus: 64                   # accelerators of any model
          gpu_models: {H100: 32, npu: 16}   # by model, or by class (gpu, npu: the catalog's kind)
          fp16_tflops: 40000         # normalized FP16 TFLOPS (catalog figure x devices)
          cpu: 2048                  # cores
          mem_gb: 16384
          jobs: 500                  # concurrent (PLACED or RUNNING) jobs
        regions:                     # optional: at most this much in one region
          cn-north: {gpus: 32}
        borrowing_limit: {gpus: 32}  # at most this much above its quota (absent: the cohort's)
        lending_limit: {gpus: 16}    # at most this much of its unused quota lent (absent: all)
        budget:
          usd_per_month: 50000       # per calendar month (UTC)
          gpu_hours: 20000           # per rolling window
          window: 7d
        inference:                   # the OpenAI gateway's limits, over every broker replica
          requests_per_minute: 600   # in any sliding 60 s
          tokens_per_minute: 200000  # prompt + completion, in any sliding 60 s
          budget:
            usd_per_month: 2000      # per calendar month (UTC)
            tokens_per_month: 500000000
          priority: 0                # default request priority: higher first, negative sheddable
    cohorts:
      research: {parent: org, quota: {gpus: 16}}   # nestable; a cohort may own quota itself
      org: {}
    priority_classes:                # names a job's priority_class may use
      best-effort: {value: 0, best_effort: true}
      production: {value: 500}
    fair_share: {half_life: 7d}

A key not set is not limited; a tenant not listed is not limited at all (and has weight 1).
The short form of earlier releases, `ai-lab: {gpus: 64}`, still reads as `quota: {gpus: 64}`.
Semantics: broker.placement.tenancy; of `inference`, broker.state.inference_limits (a token may
carry limits of its own too: TokenLimits, on broker.state.auth.TokenRecord).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.model.jobs import NAME_RE, Name, given
from sites.model.config import read_yaml, validate_mapping
from sites.model.durations import PositiveDuration

__all__ = [
    "DEFAULT_CLASSES",
    "Amounts",
    "Budget",
    "CohortPolicy",
    "FairShareSettings",
    "InferenceBudget",
    "InferencePolicy",
    "PriorityClass",
    "TenancyFile",
    "TenantPolicy",
    "TokenLimits",
    "load_tenancy",
]

DIMENSIONS = ("gpus", "fp16_tflops", "cpu", "mem_gb", "jobs")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Amounts(_Model):
    """An amount of each resource; None (or absent) is not limited."""

    gpus: int | None = Field(default=None, ge=0, description="accelerators of any model")
    gpu_models: dict[str, int] = Field(
        default_factory=dict,
        description="accelerators by catalog model (H100) or class (gpu, npu)",
    )
    fp16_tflops: float | None = Field(default=None, ge=0, description="normalized FP16 TFLOPS")
    cpu: int | None = Field(default=None, ge=0, description="CPU cores")
    mem_gb: float | None = Field(default=None, ge=0, description="memory, GB")
    jobs: int | None = Field(default=None, ge=0, description="concurrent jobs")

    def flat(self, region: str | None = None) -> dict[str, float]:
        """key -> amount for the set fields: 'gpus', 'gpus/H100', ...; 'gpus@cn-north' with a
        region (broker.placement.tenancy's keys)."""
        at = "" if region is None else f"@{region}"
        out: dict[str, float] = {}
        for name in DIMENSIONS:
            value = getattr(self, name)
            if value is not None:
                out[name + at] = float(value)
        for model, count in self.gpu_models.items():
            out[f"gpus/{model}{at}"] = float(count)
        return out

    def __bool__(self) -> bool:
        return bool(self.flat())


def _limited(name: str) -> dict[str, Any]:
    """JSON Schema: the object's `name` is Amounts that limit something (Amounts.__bool__)."""
    some = [given(dimension) for dimension in DIMENSIONS]
    some.append({"required": ["gpu_models"], "properties": {"gpu_models": {"minProperties": 1}}})
    return {"required": [name], "properties": {name: {"type": "object", "anyOf": some}}}


class Budget(_Model):
    usd_per_month: float | None = Field(
        default=None, gt=0, description="USD per calendar month (UTC)"
    )
    gpu_hours: float | None = Field(default=None, gt=0, description="GPU-hours per window")
    window: PositiveDuration = Field(default=30 * 86400.0, gt=0, description="the gpu_hours window")


class InferenceBudget(_Model):
    """What a tenant's (or a token's) inference may spend per calendar month (UTC)."""

    usd_per_month: float | None = Field(
        default=None, gt=0, description="USD of inference per calendar month (UTC)"
    )
    tokens_per_month: int | None = Field(
        default=None, ge=1, description="prompt + completion tokens per calendar month (UTC)"
    )


class TokenLimits(_Model):
    """Inference rate limits and budget, held by all broker replicas together
    (broker.state.inference_limits); None (or absent) is not limited. On a tenant's policy
    (its `inference`) and, optionally, on an API token (it applies on top of its tenant's)."""

    requests_per_minute: int | None = Field(
        default=None, ge=1, description="requests admitted in any sliding 60 s"
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="prompt + completion tokens in any sliding 60 s (charged after the response)",
    )
    budget: InferenceBudget | None = None

    @property
    def limited(self) -> bool:
        budget = self.budget
        return (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or (
                budget is not None
                and (budget.usd_per_month, budget.tokens_per_month) != (None,) * 2
            )
        )


PRIORITY_RANGE = 1000


class InferencePolicy(TokenLimits):
    """A tenant's `inference` section: its limits and its requests' default priority."""

    priority: int = Field(
        default=0,
        ge=-PRIORITY_RANGE,
        le=PRIORITY_RANGE,
        description="default request priority: higher first; negative is shed first when busy",
    )


class TenantPolicy(_Model):
    """A tenant's policy; that its cohort exists is not expressible in JSON Schema (a 400
    names cohort)."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"anyOf": [_limited("borrowing_limit"), _limited("lending_limit")]},
            "then": given("cohort"),
        }
    )

    quota: Amounts = Field(default_factory=Amounts, description="nominal, federation-wide")
    regions: dict[Name, Amounts] = Field(
        default_factory=dict,
        description="per-region caps",
        json_schema_extra={"propertyNames": {"pattern": NAME_RE}},
    )
    cohort: Name | None = None
    weight: float = Field(default=1.0, gt=0, le=1000, description="fair-share weight")
    borrowing_limit: Amounts | None = None
    lending_limit: Amounts | None = None
    budget: Budget | None = None
    inference: InferencePolicy | None = Field(
        default=None, description="inference limits, budget and default priority (none: unlimited)"
    )

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        # `{gpus: N}` (the first release's form) is `{quota: {gpus: N}}`
        if isinstance(data, dict) and "gpus" in data and "quota" not in data:
            data = dict(data)
            data["quota"] = {"gpus": data.pop("gpus")}
        return data

    @model_validator(mode="after")
    def _limits_need_a_cohort(self) -> TenantPolicy:
        if self.cohort is None and (self.borrowing_limit or self.lending_limit):
            raise ValueError("borrowing_limit and lending_limit need a cohort")
        return self


class CohortPolicy(_Model):
    """A cohort's policy; that its parent exists is not expressible in JSON Schema (a 400
    names parent)."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"anyOf": [_limited("borrowing_limit"), _limited("lending_limit")]},
            "then": given("parent"),
        }
    )

    parent: Name | None = None
    quota: Amounts = Field(default_factory=Amounts, description="the cohort's own pool")
    borrowing_limit: Amounts | None = None
    lending_limit: Amounts | None = None

    @model_validator(mode="after")
    def _limits_need_a_parent(self) -> CohortPolicy:
        if self.parent is None and (self.borrowing_limit or self.lending_limit):
            raise ValueError("borrowing_limit and lending_limit need a parent cohort")
        return self


class PriorityClass(_Model):
    value: int = Field(ge=0, le=1000, description="the job's priority")
    best_effort: bool = Field(
        default=False,
        description="runs on oversubscribed capacity, is preempted first, billed as such",
    )
    preempts: bool = Field(default=True, description="may preempt lower-priority work")
    description: str = ""


DEFAULT_CLASSES: dict[str, PriorityClass] = {
    "best-effort": PriorityClass(
        value=0, best_effort=True, preempts=False, description="spare capacity; preempted first"
    ),
    "batch": PriorityClass(value=100, description="the default for throughput work"),
    "production": PriorityClass(value=500, description="preempts batch and best-effort work"),
    "critical": PriorityClass(value=900, description="preempts everything below it"),
}


class FairShareSettings(_Model):
    half_life: PositiveDuration = Field(
        default=7 * 86400.0, gt=0, description="usage decays by half every half_life (Slurm's 7d)"
    )


class TenancyFile(_Model):
    """The tenancy file; what JSON Schema cannot say is a 400 naming the field: a name both a
    tenant's and a cohort's, a cohort or parent the file does not define."""

    tenants: dict[Name, TenantPolicy] = Field(default_factory=dict)
    cohorts: dict[Name, CohortPolicy] = Field(default_factory=dict)
    priority_classes: dict[Name, PriorityClass] = Field(
        default_factory=lambda: dict(DEFAULT_CLASSES)
    )
    fair_share: FairShareSettings = Field(default_factory=FairShareSettings)
    preemption: bool = Field(default=True, description="False: no job is ever preempted")

    @model_validator(mode="after")
    def _references(self) -> TenancyFile:
        both = sorted(set(self.tenants) & set(self.cohorts))
        if both:
            raise ValueError(f"names used by both a tenant and a cohort: {', '.join(both)}")
        for name, tenant in self.tenants.items():
            if tenant.cohort is not None and tenant.cohort not in self.cohorts:
                raise ValueError(f"tenant {name}: unknown cohort {tenant.cohort!r}")
        for name, cohort in self.cohorts.items():
            if cohort.parent is not None and cohort.parent not in self.cohorts:
                raise ValueError(f"cohort {name}: unknown parent {cohort.parent!r}")
            seen = {name}
            up = cohort.parent
            while up is not None:
                if up in seen:
                    raise ValueError(f"cohort {name}: its parents form a cycle through {up!r}")
                seen.add(up)
                up = self.cohorts[up].parent
        return self

    def with_tenant(self, name: str, policy: TenantPolicy | None) -> TenancyFile:
        """A copy with tenant `name` set (None: removed), validated again."""
        tenants = {k: v for k, v in self.tenants.items() if k != name}
        if policy is not None:
            tenants[name] = policy
        return TenancyFile.model_validate({**self.model_dump(), "tenants": tenants})


def load_tenancy(path: Path) -> TenancyFile:
    """configs/tenants.yaml; an absent file is no tenants (nobody limited)."""
    if not path.exists():
        return TenancyFile()
    return validate_mapping(str(path), read_yaml(path) or {}, TenancyFile, "with tenants")
