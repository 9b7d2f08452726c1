"""`cpn token create|list|revoke`, `cpn audit`, `cpn whoami`: API tokens, the audit log of
what was done with them, and the token in use (docs/auth.md). `cpn token list --stale 90d`
lists the tokens no request has carried for 90 days (the broker records each token's last use
to the minute).

`cpn token create --etcd` writes the token straight into etcd: how the first admin token is
made, before any token can ask the broker for one. `--rpm`, `--tpm`, `--usd-per-month` and
`--tokens-per-month` give the token inference limits of its own, on top of its tenant's.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cpn import render
from cpn.cli_base import BrokerArg, CliParser, UsageError, registry_of
from cpn.client import ApiError, BrokerClient
from sites.kits.clock import SystemClock

if TYPE_CHECKING:
    from broker.model.tenants import TokenLimits

__all__ = [
    "add_parsers",
    "add_whoami",
    "cmd_audit",
    "cmd_token_create",
    "cmd_token_list",
    "cmd_token_revoke",
    "cmd_whoami",
    "stale_tokens",
    "token_limits",
]


async def cmd_token_create(args: argparse.Namespace) -> int:
    """Through the broker (with a token that may), or straight into etcd with --etcd (or
    $CPN_ETCD and no token configured): how the first admin token is made."""
    from broker.model.errors import InvalidRequest
    from broker.state.auth import Role, create_token, new_token
    from sites.model.durations import parse_duration_s

    try:
        ttl_s = parse_duration_s(args.ttl) if args.ttl else None
        role = Role(args.role)
    except ValueError as exc:
        raise UsageError(f"--ttl/--role: {exc}") from None
    limits = token_limits(args)
    direct = args.etcd or (os.environ.get("CPN_ETCD") and not _have_token(args.broker))
    if direct:
        try:
            record, token = new_token(
                role=role,
                tenant=args.tenant,
                now=SystemClock().time(),
                created_by="etcd",
                ttl_s=ttl_s,
                description=args.description,
                limits=limits,
            )
        except InvalidRequest as exc:
            raise UsageError(f"--{exc.field or 'tenant'}: {exc.message}") from None
        async with registry_of(args) as registry:
            await create_token(registry, record)
        created: dict[str, Any] = {"token": token, **record.public()}
    else:
        body: dict[str, Any] = {"role": role.value, "description": args.description}
        if args.tenant:
            body["tenant"] = args.tenant
        if ttl_s:
            body["ttl_s"] = ttl_s
        if limits is not None:
            body["limits"] = limits.model_dump(mode="json", exclude_none=True)
        async with BrokerClient.to(args.broker) as client:
            created = await client.call("POST", "/v1/tokens", body)
    if args.output == "json":
        print(json.dumps(created, indent=2))
    elif args.output == "token":
        print(created["token"])
    else:
        scope = f" of tenant {created['tenant']}" if created.get("tenant") else ""
        print(f"token {created['id']} ({created['role']}{scope}); it is shown only once:")
        print(created["token"])
    return 0


LIMIT_FLAGS = (
    # (flag, dest, where in TokenLimits)
    ("--rpm", "rpm", ("requests_per_minute",)),
    ("--tpm", "tpm", ("tokens_per_minute",)),
    ("--usd-per-month", "usd_per_month", ("budget", "usd_per_month")),
    ("--tokens-per-month", "tokens_per_month", ("budget", "tokens_per_month")),
)


def token_limits(args: argparse.Namespace) -> TokenLimits | None:
    """The token's own inference limits from its flags; None where no flag is given. A bad
    value is a UsageError (exit 2) naming its flag."""
    from pydantic import ValidationError

    from broker.model.tenants import TokenLimits

    body: dict[str, Any] = {}
    flags: dict[tuple[str, ...], str] = {}
    for flag, dest, path in LIMIT_FLAGS:
        value = getattr(args, dest, None)
        if value is None:
            continue
        flags[path] = flag
        if len(path) == 1:
            body[path[0]] = value
        else:
            body.setdefault("budget", {})[path[1]] = value
    if not body:
        return None
    try:
        return TokenLimits.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        flag = flags.get(tuple(str(p) for p in first["loc"]), "--rpm/--tpm")
        raise UsageError(f"{flag}: {first['msg']}") from None


def _have_token(explicit: str | None) -> bool:
    from cpn.client import connection

    try:
        return connection(explicit)[1] is not None
    except ApiError:
        return False


def stale_tokens(
    tokens: list[dict[str, Any]], *, now: float, older_than_s: float
) -> list[dict[str, Any]]:
    """The tokens not used for `older_than_s` seconds: last used before then, or never used
    and created before then."""
    cutoff = now - older_than_s
    return [t for t in tokens if (t.get("last_used_at") or t["created_at"]) <= cutoff]


async def cmd_token_list(args: argparse.Namespace) -> int:
    from sites.model.durations import parse_duration_s

    older_than_s = None
    if args.stale is not None:
        try:
            older_than_s = parse_duration_s(args.stale)
        except ValueError as exc:
            raise UsageError(f"--stale: {exc}") from None
    async with BrokerClient.to(args.broker) as client:
        tokens = await client.call("GET", "/v1/tokens")
    if older_than_s is not None:
        tokens = stale_tokens(tokens, now=SystemClock().time(), older_than_s=older_than_s)
    if args.output == "json":
        print(json.dumps(tokens, indent=2))
    else:
        print(render.tokens_table(tokens, now=SystemClock().time()))
    return 0


async def cmd_token_revoke(args: argparse.Namespace) -> int:
    async with BrokerClient.to(args.broker) as client:
        record = await client.call("DELETE", f"/v1/tokens/{args.id}")
    print(f"token {record['id']} revoked")
    return 0


async def cmd_audit(args: argparse.Namespace) -> int:
    params = {"tenant": args.tenant} if args.tenant else {}
    if args.limit < 1:
        raise UsageError("--limit must be at least 1")
    rows: list[dict[str, Any]] = []
    async with BrokerClient.to(args.broker) as client:
        async for items in client.pages("/v1/audit", params, limit=args.limit):
            rows += items
    if args.output == "json":
        print(json.dumps(rows, indent=2))
    else:
        print(render.audit_table(rows))
    return 0


async def cmd_whoami(args: argparse.Namespace) -> int:
    from cpn.sdk.client import AsyncClient  # here: `cpn --help` does without the SDK's models

    async with AsyncClient(args.broker, timeout_s=None) as client:
        me = (await client.whoami()).model_dump(mode="json")
    if args.output == "json":
        print(json.dumps(me, indent=2))
    elif not me["auth"]:
        print("this broker does not check tokens (auth.enabled: false)")
    else:
        scope = f" of tenant {me['tenant']}" if me.get("tenant") else ""
        print(f"token {me['token_id']}: {me['role']}{scope}")
    return 0


def add_parsers(add: Callable[..., argparse.ArgumentParser], broker_arg: BrokerArg) -> None:
    """`cpn token ...` and `cpn audit`, added with cpn.cli's `add` and `broker_arg`."""
    token = add("token", help="create, list or revoke API tokens (docs/auth.md)")
    token_sub = token.add_subparsers(dest="token_command", required=True, parser_class=CliParser)
    create = token_sub.add_parser("create", help="a new token; printed once")
    create.add_argument(
        "--role",
        required=True,
        choices=("admin", "operator", "tenant-admin", "tenant-user", "viewer"),
    )
    create.add_argument("--tenant", help="the tenant (tenant-admin, tenant-user, viewer)")
    create.add_argument("--ttl", metavar="DURATION", help="lifetime, e.g. 30d or 12h")
    create.add_argument("--description", default="", help="what it is for")
    limits = create.add_argument_group("inference limits of this token, on top of its tenant's")
    limits.add_argument("--rpm", metavar="N", help="requests per minute")
    limits.add_argument("--tpm", metavar="N", help="tokens (prompt + completion) per minute")
    limits.add_argument("--usd-per-month", metavar="USD", help="inference USD per month (UTC)")
    limits.add_argument("--tokens-per-month", metavar="N", help="tokens per month (UTC)")
    create.add_argument(
        "--etcd",
        metavar="URL[,URL...]",
        help="write it straight into etcd (bootstrap: the first admin token)",
    )
    broker_arg(create, ("table", "json", "token"))
    create.set_defaults(func=cmd_token_create)
    tlist = token_sub.add_parser(
        "list", aliases=["ls"], help="the tokens you may see (never their secrets)"
    )
    tlist.add_argument(
        "--stale",
        metavar="DURATION",
        help="only those unused for DURATION (e.g. 90d): last used, or created, before then",
    )
    broker_arg(tlist)
    tlist.set_defaults(func=cmd_token_list)
    trevoke = token_sub.add_parser("revoke", help="revoke a token on every broker replica")
    trevoke.add_argument("id", metavar="ID")
    broker_arg(trevoke)
    trevoke.set_defaults(func=cmd_token_revoke)

    audit = add("audit", help="the audit log, newest first")
    audit.add_argument("--tenant", help="only this tenant's entries")
    audit.add_argument("--limit", type=int, default=100, metavar="N")
    broker_arg(audit)
    audit.set_defaults(func=cmd_audit)


def add_whoami(add: Callable[..., argparse.ArgumentParser], broker_arg: BrokerArg) -> None:
    """`cpn whoami`: added last, where `cpn --help` lists it."""
    whoami = add("whoami", help="the token in use: its id, role and tenant")
    broker_arg(whoami)
    whoami.set_defaults(func=cmd_whoami)
