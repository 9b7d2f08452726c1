"""`cpn tenants`, `cpn tenants apply FILE`, `cpn tenant show|set|delete NAME`: the tenancy
API's commands (docs/tenancy.md).

`cpn tenant set` reads the tenant's policy (GET /v1/tenants/NAME), changes what its flags name
and puts it back (PUT): a flag not given leaves its part as it was, `none` removes a limit.
`-f FILE` starts from a whole policy in a file instead. A flag's bad value exits 2 with one
line (FlagError is a ValueError, which cpn.cli.main reports so); the broker's refusal of a
value names the policy's field.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from cpn import render
from cpn.client import ApiError, BrokerClient
from sites.model.config import read_yaml

__all__ = ["FlagError", "add_parsers", "inference_line", "merged_policy", "tenants_table"]

AMOUNT_KEYS = ("gpus", "fp16_tflops", "cpu", "mem_gb", "jobs")
_WHOLE = frozenset({"gpus", "cpu", "jobs"})  # whole numbers; fp16_tflops and mem_gb are not
NONE = "none"


class FlagError(ValueError):
    """A flag's value the CLI cannot use: exit 2 with one line."""


# -- flags -> policy (pure) ------------------------------------------------------------------


def _number(flag: str, text: str, whole: bool) -> int | float | None:
    """A flag's amount: None for 'none' (no limit)."""
    if text.strip().lower() == NONE:
        return None
    try:
        return int(text) if whole else float(text)
    except ValueError:
        kind = "a whole number" if whole else "a number"
        raise FlagError(f"{flag}: expected {kind} or 'none', got {text!r}") from None


def _set(target: dict[str, Any], key: str, value: object) -> None:
    if value is None:
        target.pop(key, None)
    else:
        target[key] = value


def _amounts_flag(flag: str, text: str) -> dict[str, Any] | None:
    """'gpus=32,cpu=512,gpus/H100=16' -> an Amounts body; None for 'none'."""
    if text.strip().lower() == NONE:
        return None
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key:
            raise FlagError(f"{flag}: expected KEY=N[,KEY=N...], got {text!r}")
        if key.startswith("gpus/"):
            models = out.setdefault("gpu_models", {})
            _set(models, key.removeprefix("gpus/"), _number(flag, value, True))
        elif key in AMOUNT_KEYS:
            _set(out, key, _number(flag, value, key in _WHOLE))
        else:
            keys = ", ".join((*AMOUNT_KEYS, "gpus/MODEL"))
            raise FlagError(f"{flag}: unknown key {key!r} (one of {keys})")
    return out


def _duration(text: str) -> float | str | None:
    """--window: seconds, or a duration the broker reads ('7d', '1d12h'); None for 'none'."""
    if text.strip().lower() == NONE:
        return None
    try:
        return float(text)
    except ValueError:
        return text.strip()


def _limit(policy: dict[str, Any], name: str, gpus: str | None, flag: str) -> None:
    if gpus is None:
        return
    limit = dict(policy.get(name) or {})
    _set(limit, "gpus", _number(flag, gpus, True))
    policy[name] = limit if any(v not in (None, {}) for v in limit.values()) else None


def merged_policy(base: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`base` (a TenantPolicy as JSON, or {}) with the flags of `cpn tenant set` applied."""
    policy = copy.deepcopy(dict(base))
    if "gpus" in policy and "quota" not in policy:  # the short form, {gpus: N}
        policy["quota"] = {"gpus": policy.pop("gpus")}
    quota = dict(policy.get("quota") or {})
    for key in AMOUNT_KEYS:
        text = getattr(args, key)
        if text is not None:
            _set(quota, key, _number(f"--{key.replace('_', '-')}", text, key in _WHOLE))
    for item in args.gpu_model or ():
        model, sep, count = item.partition("=")
        if not sep or not model:
            raise FlagError(f"--gpu-model: expected MODEL=N, got {item!r}")
        models = dict(quota.get("gpu_models") or {})
        _set(models, model, _number("--gpu-model", count, True))
        quota["gpu_models"] = models
    policy["quota"] = quota
    for item in args.region or ():
        region, sep, amounts = item.partition(":")
        if not sep or not region:
            raise FlagError(f"--region: expected REGION:KEY=N[,KEY=N...], got {item!r}")
        regions = dict(policy.get("regions") or {})
        caps = _amounts_flag("--region", amounts)
        if caps is None:
            regions.pop(region, None)
        else:
            merged = {**(regions.get(region) or {}), **caps}
            if "gpu_models" in caps:
                old = (regions.get(region) or {}).get("gpu_models") or {}
                merged["gpu_models"] = {**old, **caps["gpu_models"]}
            regions[region] = merged
        policy["regions"] = regions
    if args.cohort is not None:
        policy["cohort"] = None if args.cohort.lower() == NONE else args.cohort
    if args.weight is not None:
        weight = _number("--weight", args.weight, False)
        if weight is None:
            raise FlagError("--weight: expected a number, got 'none'")
        policy["weight"] = weight
    _limit(policy, "borrowing_limit", args.borrowing_limit_gpus, "--borrowing-limit-gpus")
    _limit(policy, "lending_limit", args.lending_limit_gpus, "--lending-limit-gpus")
    _inference_flags(policy, args)
    if any(v is not None for v in (args.usd_per_month, args.gpu_hours, args.window)):
        budget = dict(policy.get("budget") or {})
        if args.usd_per_month is not None:
            _set(budget, "usd_per_month", _number("--usd-per-month", args.usd_per_month, False))
        if args.gpu_hours is not None:
            _set(budget, "gpu_hours", _number("--gpu-hours", args.gpu_hours, False))
        if args.window is not None:
            _set(budget, "window", _duration(args.window))
        limits = (budget.get("usd_per_month"), budget.get("gpu_hours"))
        policy["budget"] = budget if any(v is not None for v in limits) else None
    return policy


INFERENCE_FLAGS = (
    # (flag, dest, where in `inference`, whole number)
    ("--rpm", "rpm", ("requests_per_minute",), True),
    ("--tpm", "tpm", ("tokens_per_minute",), True),
    ("--inference-usd-per-month", "inference_usd", ("budget", "usd_per_month"), False),
    ("--inference-tokens-per-month", "inference_tokens", ("budget", "tokens_per_month"), True),
    ("--priority", "priority", ("priority",), True),
)


def _inference_flags(policy: dict[str, Any], args: argparse.Namespace) -> None:
    """The `inference` section with --rpm, --tpm, --inference-*-per-month, --priority applied;
    a section left with nothing set is removed."""
    given = [(f, d, path, whole) for f, d, path, whole in INFERENCE_FLAGS if getattr(args, d)]
    if not given:
        return
    inference = copy.deepcopy(dict(policy.get("inference") or {}))
    for flag, dest, path, whole in given:
        value = _number(flag, getattr(args, dest), whole)
        if len(path) == 1:
            _set(inference, path[0], value)
        else:
            budget = dict(inference.get("budget") or {})
            _set(budget, path[1], value)
            inference["budget"] = budget if any(v is not None for v in budget.values()) else None
    kept = {k: v for k, v in inference.items() if v is not None}
    policy["inference"] = kept or None


def _flags_given(args: argparse.Namespace) -> bool:
    names = (*AMOUNT_KEYS, "gpu_model", "region", "cohort", "weight", "borrowing_limit_gpus",
             "lending_limit_gpus", "usd_per_month", "gpu_hours", "window",
             *(dest for _, dest, _, _ in INFERENCE_FLAGS))  # fmt: skip
    return any(getattr(args, name) is not None for name in names)


# -- output ----------------------------------------------------------------------------------


def _num(value: float, decimals: int = 2) -> str:
    if abs(value - round(value)) < 1e-6:
        return f"{round(value):,}"
    return f"{value:,.{decimals}f}" if abs(value) >= 1 else f"{value:.3g}"


def _amounts(values: Mapping[str, float] | None) -> str:
    if not values:
        return "-"
    if set(values) == {"gpus"}:
        return _num(values["gpus"])
    return ", ".join(f"{k} {_num(v)}" for k, v in sorted(values.items()))


def _budget(budget: Mapping[str, Any] | None) -> str:
    if not budget:
        return "-"
    parts = []
    if budget.get("usd_total") is not None:
        parts.append(f"${_num(budget['usd_left'])}/{_num(budget['usd_total'])}")
    if budget.get("gpu_hours_total") is not None:
        left, total = budget["gpu_hours_left"], budget["gpu_hours_total"]
        parts.append(f"{_num(left, 1)}/{_num(total, 1)} GPU-h")
    return ", ".join(parts) or "-"


def _gpus(status: Mapping[str, Any]) -> str:
    quota = status["quota"].get("gpus")
    return f"{_num(status['use'].get('gpus', 0))}/{'-' if quota is None else _num(quota)}"


TENANT_HEADERS = ("TENANT", "WEIGHT", "COHORT", "GPUS USED/QUOTA", "BORROWED", "LENT", "SHARE",
                  "BUDGET LEFT", "PENDING", "INFERENCE")  # fmt: skip


def _short(value: float) -> str:
    """12,500 -> 12.5k; 2,000,000 -> 2M (a table's compact figure)."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return _num(value)


def _figure(used: Mapping[str, Any], unit: str, money: bool = False) -> str | None:
    """'used/limit unit' (the limit alone where the broker does not count); None: no limit."""
    if used.get("limit") is None:
        return None
    fmt = (lambda v: f"${_num(v)}") if money else _short
    limit = fmt(used["limit"])
    return f"{limit}{unit}" if used.get("used") is None else f"{fmt(used['used'])}/{limit}{unit}"


def inference_line(inference: Mapping[str, Any] | None) -> str:
    """A tenant's inference limits in one cell: '12/600 rpm, 45k/200k tpm, $12.5/$2,000 mo'."""
    if not inference:
        return "-"
    parts = [
        _figure(inference["requests_per_minute"], " rpm"),
        _figure(inference["tokens_per_minute"], " tpm"),
        _figure(inference["tokens_this_month"], " tok/mo"),
        _figure(inference["usd_this_month"], "/mo", money=True),
    ]
    shown = [p for p in parts if p is not None]
    if inference.get("priority"):
        shown.append(f"prio {inference['priority']}")
    return ", ".join(shown) or "not limited"


def tenants_table(items: list[dict[str, Any]]) -> str:
    rows = [
        [
            t["tenant"] + ("" if t["configured"] else " (not limited)"),
            f"{t['weight']:g}",
            t["cohort"] or "-",
            _gpus(t),
            _amounts(t["borrowed"]),
            _amounts(t["lent"]),
            f"{t['share']:.3f}",
            _budget(t["budget"]),
            str(t["pending"]),
            inference_line(t.get("inference")),
        ]
        for t in items
    ]
    return render.table(TENANT_HEADERS, rows) if rows else "no tenants"


def describe_tenant(t: Mapping[str, Any]) -> str:
    available = t["available"]
    lines = [
        f"Tenant:      {t['tenant']}" + ("" if t["configured"] else " (no policy: not limited)"),
        f"Weight:      {t['weight']:g}",
        f"Cohort:      {t['cohort'] or '-'}",
        f"Quota:       {_named(t['quota'])}",
        f"Use:         {_named(t['use'])}",
        f"Borrowed:    {_named(t['borrowed'])}",
        f"Lent:        {_named(t['lent'])}",
        f"Available:   {'not limited' if available is None else _named(available)}",
        f"Share:       {t['share']:.4f}",
        f"Budget left: {_budget(t['budget'])}",
        f"Pending:     {t['pending']} job(s)",
    ]
    lines += _inference_lines(t.get("inference"))
    if t.get("policy"):
        text = yaml.safe_dump(_without_nulls(t["policy"]), sort_keys=False).rstrip()
        lines += ["Policy:", *("  " + line for line in text.splitlines())]
    return "\n".join(lines)


TOKEN_FIGURES = (
    ("requests_per_minute", "rpm"),
    ("tokens_per_minute", "tpm"),
    ("tokens_this_month", "tokens/month"),
    ("usd_this_month", "USD/month"),
)


def _inference_lines(inference: Mapping[str, Any] | None) -> list[str]:
    """`cpn tenant show`'s inference part: each limit, what all replicas used of it."""
    if not inference:
        return ["Inference:   not limited"]
    out = [f"Inference:   priority {inference['priority']}, month {inference['month']} (UTC)"]
    rows = (
        ("requests/min", inference["requests_per_minute"], False),
        ("tokens/min", inference["tokens_per_minute"], False),
        ("tokens/month", inference["tokens_this_month"], False),
        ("USD/month", inference["usd_this_month"], True),
    )
    for label, used, money in rows:
        out.append(f"  {label + ':':<14}{_used(used, money)}")
    for token_id, figures in (inference.get("tokens") or {}).items():
        limited = [
            f"{label} {_used(figures[key], key == 'usd_this_month')}"
            for key, label in TOKEN_FIGURES
            if figures[key]["limit"] is not None
        ]
        out.append(f"  token {token_id}: {', '.join(limited) or 'not limited'}")
    return out


def _used(used: Mapping[str, Any], money: bool) -> str:
    fmt = (lambda v: f"${_num(v)}") if money else _num
    limit = "not limited" if used["limit"] is None else f"limit {fmt(used['limit'])}"
    if used["used"] is None:
        return limit
    return f"{fmt(used['used'])} used, {limit}"


def _named(values: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {_num(v)}" for k, v in values.items()) or "-"


def _without_nulls(value: Any) -> Any:
    """A policy as JSON without its unset parts, as one would write it in a file."""
    if isinstance(value, dict):
        kept = {k: _without_nulls(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, {}, [])}
    return value


# -- commands --------------------------------------------------------------------------------


def _mapping(path: str, what: str) -> tuple[dict[str, Any], str]:
    """A YAML file's mapping and its text (ConfigError, exit 2, if it does not read)."""
    data = read_yaml(Path(path))
    if not isinstance(data, dict):
        raise FlagError(f"{path}: expected a mapping {what}")
    return data, Path(path).read_text()


async def cmd_tenants(args: argparse.Namespace) -> int:
    if args.tenants_command == "apply":
        if args.file is None:
            raise FlagError("cpn tenants apply needs FILE (a tenants.yaml)")
        data, text = _mapping(args.file, "of tenants, cohorts, priority_classes")
        async with BrokerClient.to(args.broker) as client:
            applied = await client.call("PUT", "/v1/tenancy", yaml=text)
        if args.output == "json":
            print(json.dumps(applied, indent=2))
        else:
            print(
                f"tenancy applied: {len(applied['tenants'])} tenant(s), "
                f"{len(applied['cohorts'])} cohort(s) (from {args.file})"
            )
        return 0
    if args.file is not None:
        raise FlagError(f"unexpected argument {args.file!r} (cpn tenants apply FILE?)")
    async with BrokerClient.to(args.broker) as client:
        answer = await client.call("GET", "/v1/tenants")
    if args.output == "json":
        print(json.dumps(answer["items"], indent=2))
    else:
        print(tenants_table(answer["items"]))
    return 0


async def cmd_tenant_show(args: argparse.Namespace) -> int:
    async with BrokerClient.to(args.broker) as client:
        tenant = await client.call("GET", f"/v1/tenants/{args.name}")
    print(json.dumps(tenant, indent=2) if args.output == "json" else describe_tenant(tenant))
    return 0


async def cmd_tenant_set(args: argparse.Namespace) -> int:
    async with BrokerClient.to(args.broker) as client:
        try:
            existing = await client.call("GET", f"/v1/tenants/{args.name}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            existing = None
        current = (existing or {}).get("policy")
        if args.file is not None:
            base, text = _mapping(args.file, "of tenant policy fields")
        else:
            base, text = current or {}, None
        if text is not None and not _flags_given(args):
            tenant = await client.call("PUT", f"/v1/tenants/{args.name}", yaml=text)
        else:
            policy = merged_policy(base, args)
            try:
                json.dumps(policy, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise FlagError(f"{args.file}: {exc}") from None
            tenant = await client.call("PUT", f"/v1/tenants/{args.name}", policy)
    if args.output == "json":
        print(json.dumps(tenant, indent=2))
    else:
        done = "updated" if current is not None else "created"
        print(
            f"tenant {args.name} {done}: GPUs {_gpus(tenant)}, weight {tenant['weight']:g}, "
            f"cohort {tenant['cohort'] or '-'}, budget left {_budget(tenant['budget'])}"
        )
    return 0


async def cmd_tenant_delete(args: argparse.Namespace) -> int:
    async with BrokerClient.to(args.broker) as client:
        removed = await client.call("DELETE", f"/v1/tenants/{args.name}")
    if args.output == "json":
        print(json.dumps(removed, indent=2))
    else:
        print(f"tenant {args.name} deleted: it is not limited from now on")
    return 0


# -- parsers ---------------------------------------------------------------------------------


def add_parsers(
    add: Callable[..., argparse.ArgumentParser],
    broker_arg: Callable[[argparse.ArgumentParser], None],
) -> None:
    """`cpn tenants` and `cpn tenant ...`, added with cpn.cli's `add` (sub.add_parser) and
    `broker_arg` (--broker, -o)."""
    tenants = add("tenants", help="tenants' quota, use, borrowing, share, budget (docs/tenancy.md)")
    tenants.add_argument(
        "tenants_command", nargs="?", choices=("apply",), help="apply: PUT a whole tenants.yaml"
    )
    tenants.add_argument("file", nargs="?", metavar="FILE", help="apply: the tenants.yaml")
    broker_arg(tenants)
    tenants.set_defaults(func=cmd_tenants)

    tenant = add("tenant", help="show, set or delete one tenant's policy")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True)
    show = tenant_sub.add_parser("show", help="a tenant's standing and policy")
    show.add_argument("name", metavar="NAME")
    broker_arg(show)
    show.set_defaults(func=cmd_tenant_show)

    set_ = tenant_sub.add_parser(
        "set", help="change a tenant's policy: the flags given (none: no limit), or -f FILE"
    )
    set_.add_argument("name", metavar="NAME")
    set_.add_argument("-f", "--file", metavar="FILE", help="a whole TenantPolicy (YAML)")
    quota = set_.add_argument_group("quota (federation-wide; 'none' removes a limit)")
    quota.add_argument("--gpus", metavar="N", help="accelerators of any model")
    quota.add_argument(
        "--gpu-model", action="append", metavar="MODEL=N", help="of a model or class (repeatable)"
    )
    quota.add_argument("--fp16-tflops", dest="fp16_tflops", metavar="X", help="normalized")
    quota.add_argument("--cpu", metavar="N", help="cores")
    quota.add_argument("--mem-gb", dest="mem_gb", metavar="X", help="memory, GB")
    quota.add_argument("--jobs", metavar="N", help="jobs placed or running at once")
    quota.add_argument(
        "--region",
        action="append",
        metavar="REGION:KEY=N[,KEY=N]",
        help="a cap in one region, e.g. cn-north:gpus=32 (repeatable; REGION:none removes it)",
    )
    share = set_.add_argument_group("cohort and fair share")
    share.add_argument("--cohort", metavar="NAME", help="borrow from and lend to it (none: leave)")
    share.add_argument("--weight", metavar="W", help="fair-share weight (default 1)")
    share.add_argument("--borrowing-limit-gpus", metavar="N", help="at most N above the quota")
    share.add_argument("--lending-limit-gpus", metavar="N", help="lend at most N of the quota")
    budget = set_.add_argument_group("budget")
    budget.add_argument("--usd-per-month", metavar="USD", help="per calendar month (UTC)")
    budget.add_argument("--gpu-hours", metavar="H", help="per window")
    budget.add_argument("--window", metavar="DURATION", help="the GPU-hours window, e.g. 7d")
    infer = set_.add_argument_group("inference (all broker replicas together; 'none' removes)")
    infer.add_argument("--rpm", metavar="N", help="requests per minute")
    infer.add_argument("--tpm", metavar="N", help="tokens (prompt + completion) per minute")
    infer.add_argument(
        "--inference-usd-per-month", dest="inference_usd", metavar="USD", help="per month (UTC)"
    )
    infer.add_argument(
        "--inference-tokens-per-month", dest="inference_tokens", metavar="N", help="per month"
    )
    infer.add_argument(
        "--priority", metavar="P", help="requests' default priority, -1000..1000 (<0 sheddable)"
    )
    broker_arg(set_)
    set_.set_defaults(func=cmd_tenant_set)

    delete = tenant_sub.add_parser("delete", help="remove a tenant's policy (it is unlimited then)")
    delete.add_argument("name", metavar="NAME")
    broker_arg(delete)
    delete.set_defaults(func=cmd_tenant_delete)
