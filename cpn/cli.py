"""The `cpn` command line.

User errors exit 2 with one line on stderr (`cpn: error: ...`); an unreachable registry or
another run-time failure exits 1. `-o json` prints machine-readable output.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn

from cpn import load_cli, render, service_cli, tenant_cli
from cpn.certs import DEFAULT_HOSTS, Pki, PkiError
from cpn.client import ApiError, BrokerClient
from cpn.config import ConfigFileError
from cpn.state import read_up_state
from sites.agent.collectors.probes import METHODS
from sites.agent.process import Agent
from sites.agent.settings import AgentSettings
from sites.kits.clock import SystemClock
from sites.model.catalog import CatalogError, DeviceCatalog
from sites.model.config import config_dir, load_site, load_sites
from sites.model.errors import AgentConflict, ConfigError, NotJoined, RegistryError, SitesError
from sites.registry.admin import auth_enabled, revoke_site
from sites.registry.client import Registry, parse_endpoints
from sites.registry.security import CREDENTIALS_ENV, EtcdTls, load_credentials

log = logging.getLogger("cpn")


class UsageError(Exception):
    """Bad input from the user: exit 2."""


class CliParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"cpn: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _etcd_url(args: argparse.Namespace) -> str:
    url: str | None = args.etcd or os.environ.get("CPN_ETCD")
    if not url:
        state = read_up_state()
        url = state.get("etcd") if state else None
    if not url:
        raise UsageError("no etcd: pass --etcd URL[,URL...], set CPN_ETCD, or start `cpn up`")
    try:
        parse_endpoints(url)
    except ValueError as exc:
        raise UsageError(f"--etcd: {exc}") from None
    return url


def _etcd_access(args: argparse.Namespace) -> tuple[str, EtcdTls | None]:
    """The etcd URL and TLS material: a credential file (--etcd-credentials, else
    $CPN_ETCD_CREDENTIALS, else the running `cpn up --secure`'s root one) names both."""
    path = getattr(args, "etcd_credentials", None) or os.environ.get(CREDENTIALS_ENV)
    if not path and not (args.etcd or os.environ.get("CPN_ETCD")):
        state = read_up_state()
        path = state.get("etcd_credentials") if state else None
    if not path:
        return _etcd_url(args), None
    creds = load_credentials(Path(path))  # its endpoints are checked with it
    return (_etcd_url(args) if args.etcd else creds.endpoints), creds.tls()


def _registry(args: argparse.Namespace) -> Registry:
    url, tls = _etcd_access(args)
    return Registry.from_urls(url, tls=tls)


def _pki(args: argparse.Namespace) -> Pki:
    from cpn.secure import default_pki_dir

    return Pki(Path(args.certs) if getattr(args, "certs", None) else default_pki_dir())


def _catalog(args: argparse.Namespace) -> DeviceCatalog:
    path = Path(args.catalog) if getattr(args, "catalog", None) else None
    return DeviceCatalog.load(path)


# -- commands ------------------------------------------------------------------------------


async def cmd_sites(args: argparse.Namespace) -> int:
    catalog = _catalog(args)
    async with _registry(args) as registry:
        snap = await registry.snapshot()
    views = snap.views()
    if args.output == "json":
        print(json.dumps([render.site_json(v, now=SystemClock().time()) for v in views], indent=2))
    elif args.nodes:
        print(render.nodes_table(views, catalog=catalog))
    else:
        print(render.sites_table(views, catalog=catalog, now=SystemClock().time()))
    return 0


def cmd_site_validate(args: argparse.Namespace) -> int:
    specs = load_sites([Path(p) for p in args.files], _catalog(args))
    for spec in specs:
        print(
            f"{spec.id}: ok ({spec.region}, {sum(p.count for p in spec.inventory.devices)} devices)"
        )
    return 0


async def cmd_site_join(args: argparse.Namespace) -> int:
    from cpn.secure import site_credentials

    specs = load_sites([Path(p) for p in args.files], _catalog(args))
    async with _registry(args) as registry:
        for spec in specs:
            new = await registry.join(spec)
            # on a secure etcd, the site's own user, which may write only the site's keys
            creds = await site_credentials(registry, _pki(args), spec)
            print(f"site {spec.id} {'joined' if new else 'updated'} ({spec.region})")
            if creds is not None:
                print(f"  etcd user site-{spec.id}; its agent's credentials: {creds}")
    return 0


async def cmd_site_leave(args: argparse.Namespace) -> int:
    clock = SystemClock()
    async with _registry(args) as registry:
        deadline = clock.monotonic() + args.wait
        while True:
            result = await registry.leave(args.site, now=clock.time())
            if result.removed:
                if registry.tls is not None and await auth_enabled(registry):
                    await revoke_site(registry, args.site)
                print(f"site {args.site} drained and removed")
                return 0
            if clock.monotonic() >= deadline:
                break
            await asyncio.sleep(min(1.0, max(0.0, deadline - clock.monotonic())))
    print(
        f"site {args.site} cordoned: no new work; {result.pending_assignments} job(s) still "
        "assigned. Run `cpn site leave` again once they finish to remove it."
    )
    return 0


def cmd_certs_init(args: argparse.Namespace) -> int:
    from cpn.secure import init_pki

    pki = _pki(args)
    created = pki.init()
    tls = init_pki(pki, args.host)
    print(f"{'created' if created else 'kept'} the CA {pki.ca_path}")
    print(f"etcd: --cert-file {tls.cert_file} --key-file {tls.key_file} ", end="")
    print(f"--trusted-ca-file {tls.ca_file} --client-cert-auth")
    print(f"broker: --tls-cert {pki.directory / 'broker.pem'} --tls-key ", end="")
    print(f"{pki.directory / 'broker-key.pem'}")
    return 0


def cmd_certs_issue(args: argparse.Namespace) -> int:
    pki = _pki(args)
    issued = pki.issue(args.name, hosts=args.host or DEFAULT_HOSTS, server=args.server)
    print(f"{issued.cert_path} {issued.key_path}")
    return 0


async def cmd_etcd_secure(args: argparse.Namespace) -> int:
    from cpn.secure import bootstrap

    url = _etcd_url(args)
    paths = await bootstrap(url, _pki(args))
    print(f"etcd auth enabled at {url}")
    for user, path in paths.items():
        print(f"  {user}: {path}")
    return 0


async def cmd_agent(args: argparse.Namespace) -> int:
    catalog = _catalog(args)
    spec = load_site(Path(args.site), catalog)
    service_urls: dict[str, str] = {}
    for item in args.service_url or []:
        name, sep, url = item.partition("=")
        if not sep or not url:
            raise UsageError(f"--service-url {item!r}: expected NAME=URL")
        service_urls[name] = url
    settings = AgentSettings.from_spec(
        spec,
        listen=args.listen,
        advertise=args.advertise,
        probe_listen=args.probe_listen,
        probe_advertise=args.probe_advertise,
        interval_s=args.interval,
        probe_method=args.probe_method,
        wan_emulated=args.wan_emulated,
        service_urls=service_urls,
    )
    async with _registry(args) as registry:
        agent = Agent(spec=spec, catalog=catalog, registry=registry, settings=settings)
        await agent.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, agent.stopped.set)
        print(f"agent of {spec.id} serving {agent.url} (pid {os.getpid()})", flush=True)
        await agent.stopped.wait()
        await agent.stop()
        if agent.stop_reason:
            print(f"agent of {spec.id} stopped: {agent.stop_reason}", file=sys.stderr)
    return 1 if agent.crashed else 0


def _load_job_file(path: str) -> Any:
    from sites.model.config import read_yaml

    data = read_yaml(Path(path))
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of job fields")
    return data


async def cmd_submit(args: argparse.Namespace) -> int:
    data = _load_job_file(args.file)  # a readable YAML mapping, or exit 2 with one line
    # sent as the YAML it is: the broker parses it (timestamps such as a deadline included)
    text = Path(args.file).read_text()
    workflow = "steps" in data  # a workflow file: a DAG of steps (docs/workflows.md)
    async with BrokerClient.to(args.broker) as client:
        path = "/v1/workflows" if workflow else "/v1/jobs"
        record = await client.call("POST", path, yaml=text)
    if args.output == "json":
        print(json.dumps(record, indent=2))
    elif workflow:
        steps = ", ".join(f"{s['name']}={s['job']}" for s in record["steps"])
        print(f"workflow {record['id']} submitted ({record['state']}): {steps}")
    else:
        print(f"job {record['id']} submitted ({record['state']})")
    return 0


JOBS_PAGE = 500


async def cmd_jobs(args: argparse.Namespace) -> int:
    """Page through GET /v1/jobs, newest first, printing each page as it comes."""
    filters = (("tenant", args.tenant), ("state", args.state), ("site", args.site))
    params = {k: v for k, v in (*filters, ("since", args.since)) if v}
    if args.all:
        params["include"] = "archived"
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    table = render.PagedTable(render.JOB_HEADERS)
    now = SystemClock().time()
    shown = 0
    if args.output == "json":
        print("[")
    async with BrokerClient.to(args.broker) as client:
        async for items in client.pages("/v1/jobs", params, limit=args.limit, page=JOBS_PAGE):
            for i, item in enumerate(items):
                if args.output == "json":
                    sep = "," if shown + i > 0 else ""
                    print(sep + json.dumps(item, indent=2))
                elif args.output == "jsonl":
                    print(json.dumps(item, separators=(",", ":")))
            if args.output == "table":
                for line in table.lines(render.job_rows(items, now=now)):
                    print(line)
            shown += len(items)
    if args.output == "json":
        print("]")
    elif args.output == "table" and shown == 0:
        print("no jobs")
    return 0


async def cmd_describe(args: argparse.Namespace) -> int:
    """A job, or else a workflow of that id (its DAG and each step's state)."""
    async with BrokerClient.to(args.broker) as client:
        try:
            record = await client.call("GET", f"/v1/jobs/{args.job}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            try:
                record = await client.call("GET", f"/v1/workflows/{args.job}")
            except ApiError as missing:
                if missing.status != 404:
                    raise
                raise ApiError(404, f"no job or workflow {args.job!r}") from None
    if args.output == "json":
        print(json.dumps(record, indent=2))
    elif "steps" in record:
        print(render.describe_workflow(record))
    else:
        print(render.describe_job(record))
    return 0


async def cmd_workflow(args: argparse.Namespace) -> int:
    """cpn workflow list | describe | cancel | retry (docs/workflows.md)."""
    params = {"step": args.step} if getattr(args, "step", None) else {}
    async with BrokerClient.to(args.broker) as client:
        if args.workflow_command == "list":
            answer = await client.call("GET", "/v1/workflows", **params)
            if args.output == "json":
                print(json.dumps(answer["items"], indent=2))
            for item in answer["items"] if args.output != "json" else ():
                print(f"{item['id']}  tenant {item['tenant']}  {item['steps']} steps")
            return 0
        if args.workflow_command == "describe":
            record = await client.call("GET", f"/v1/workflows/{args.workflow}")
        else:
            path = f"/v1/workflows/{args.workflow}/{args.workflow_command}"
            record = await client.call("POST", path, **params)
    if args.output == "json":
        print(json.dumps(record, indent=2))
    else:
        print(render.describe_workflow(record))
    return 0


async def cmd_job_action(args: argparse.Namespace) -> int:
    async with BrokerClient.to(args.broker) as client:
        record = await client.call("POST", f"/v1/jobs/{args.job}/{args.action}")
    print(f"job {record['id']} {record['state']}")
    return 0


async def cmd_logs(args: argparse.Namespace) -> int:
    params = {"follow": "1"} if args.follow else {}
    async with BrokerClient.to(args.broker) as client:
        await client.stream(f"/v1/jobs/{args.job}/logs", **params)
    return 0


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
            )
        except InvalidRequest as exc:
            raise UsageError(f"--{exc.field or 'tenant'}: {exc.message}") from None
        async with _registry(args) as registry:
            await create_token(registry, record)
        created: dict[str, Any] = {"token": token, **record.public()}
    else:
        body: dict[str, Any] = {"role": role.value, "description": args.description}
        if args.tenant:
            body["tenant"] = args.tenant
        if ttl_s:
            body["ttl_s"] = ttl_s
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


def _have_token(explicit: str | None) -> bool:
    from cpn.client import connection

    try:
        return connection(explicit)[1] is not None
    except ApiError:
        return False


async def cmd_token_list(args: argparse.Namespace) -> int:
    async with BrokerClient.to(args.broker) as client:
        tokens = await client.call("GET", "/v1/tokens")
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


async def cmd_usage(args: argparse.Namespace) -> int:
    """`cpn usage`: the ledger summed (GET /v1/usage); `cpn usage chargeback`: a month's
    chargeback CSV and PNG (metering.chargeback)."""
    from metering import chargeback

    params = {k: v for k, v in (("tenant", args.tenant), ("site", args.site)) if v}
    if args.usage_command == "chargeback":
        if args.month is None:
            raise UsageError("cpn usage chargeback needs --month YYYY-MM")
        first, last = chargeback.month_range(args.month)
        params.update({"from": first.isoformat(), "to": last.isoformat()})
        params["by"] = "tenant,site,model"
    else:
        params.update({k: v for k, v in (("from", args.from_), ("to", args.to)) if v})
        if args.by:
            params["by"] = args.by
    async with BrokerClient.to(args.broker) as client:
        report = await client.call("GET", "/v1/usage", **params)
    if args.usage_command == "chargeback":
        for path in chargeback.chargeback(report, args.month, Path(args.out)):
            print(path)
    elif args.output == "json":
        print(json.dumps(report, indent=2))
    elif args.output == "csv":
        print(chargeback.to_csv(report), end="")
    else:
        print(chargeback.to_table(report))
    return 0


async def cmd_alerts(args: argparse.Namespace) -> int:
    """`cpn alerts`: firing and recently resolved alerts (GET /v1/alerts); `cpn alerts rules`:
    the same rules as a Prometheus alerting-rules file, from configs/broker.yaml."""
    if args.alerts_command == "rules":
        from broker.leader.alert_export import rules_yaml
        from broker.placement.settings import load_settings

        where = Path(args.config_dir) if args.config_dir else config_dir()
        print(rules_yaml(load_settings(where / "broker.yaml").alerts), end="")
        return 0
    params = {"state": args.state} if args.state else {}
    rows: list[dict[str, Any]] = []
    async with BrokerClient.to(args.broker) as client:
        async for items in client.pages("/v1/alerts", params, limit=None):
            rows += items
    if args.output == "json":
        print(json.dumps(rows, indent=2))
        return 0
    now = SystemClock().time()
    print(
        render.table(
            ("STATE", "ALERT", "SEVERITY", "SUBJECT", "SINCE", "SUMMARY"),
            [
                (
                    r["state"],
                    r["alertname"],
                    r["severity"],
                    "/".join(r["subject"]),
                    render.ago(now - (r["ends_at"] or r["starts_at"])),
                    r["summary"],
                )
                for r in rows
            ],
        )
    )
    return 0


async def cmd_whoami(args: argparse.Namespace) -> int:
    async with BrokerClient.to(args.broker) as client:
        me = await client.call("GET", "/v1/whoami")
    if args.output == "json":
        print(json.dumps(me, indent=2))
    elif not me["auth"]:
        print("this broker does not check tokens (auth.enabled: false)")
    else:
        scope = f" of tenant {me['tenant']}" if me.get("tenant") else ""
        print(f"token {me['token_id']}: {me['role']}{scope}")
    return 0


async def cmd_broker(args: argparse.Namespace) -> int:
    from broker.server import serve

    etcd, etcd_tls = _etcd_access(args)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    await serve(
        etcd=etcd,
        etcd_tls=etcd_tls,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        listen=args.listen,
        config_dir=Path(args.config_dir) if args.config_dir else config_dir(),
        wan_emulated=args.wan_emulated,
    )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from simulations.cli import simulate_main

    return simulate_main(args.rest)


def cmd_plan_capacity(args: argparse.Namespace) -> int:
    from simulations.cli import plan_capacity_main

    return plan_capacity_main(args.rest)


def cmd_plan(args: argparse.Namespace) -> int:
    from broker.plan.cli import main as plan_main

    return plan_main(args.rest)


def cmd_up(args: argparse.Namespace) -> int:
    from cpn.launcher import Launcher, LaunchSettings

    if args.etcd_members < 1:
        raise UsageError(f"--etcd-members must be at least 1, got {args.etcd_members}")
    if args.etcd_members > 1 and (args.etcd or os.environ.get("CPN_ETCD")):
        raise UsageError("--etcd-members starts an embedded cluster: not with --etcd/CPN_ETCD")
    if args.secure and (args.etcd or os.environ.get("CPN_ETCD")):
        raise UsageError(
            "--secure starts its own etcd with TLS; to secure yours: cpn certs init, then "
            "cpn etcd secure (docs/auth.md)"
        )

    settings = LaunchSettings(
        config_dir=Path(args.config_dir) if args.config_dir else config_dir(),
        etcd=args.etcd or os.environ.get("CPN_ETCD"),
        interval_s=args.interval,
        wan_emulation=not args.no_wan_emulation,
        only=tuple(s for s in (args.sites or "").split(",") if s),
        broker_listen=args.broker_listen,
        etcd_members=args.etcd_members,
        secure=args.secure,
        demo_service=not args.no_service,
        service_file=Path(args.service) if args.service else None,
    )
    if args.slurm:  # one more site, slurm-lab, on a local Slurm (cpn/slurm_demo.py)
        from cpn.slurm_demo import run_with_slurm

        return run_with_slurm(settings)
    return Launcher(settings).run()


# -- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="cpn", description="cross-region computing-power network")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)

    def etcd_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--etcd",
            metavar="URL[,URL...]",
            help="etcd endpoints (default: $CPN_ETCD, else the etcd of a running `cpn up`)",
        )
        p.add_argument(
            "--etcd-credentials",
            metavar="FILE",
            help="credential file for an etcd with TLS and auth (default: "
            "$CPN_ETCD_CREDENTIALS; docs/auth.md)",
        )
        p.add_argument("--catalog", metavar="FILE", help="device catalog (configs/devices.yaml)")

    up = sub.add_parser("up", help="start a demo federation: etcd, every site's agent")
    etcd_arg(up)
    up.add_argument("--config-dir", metavar="DIR", help="configs/ directory to run")
    up.add_argument("--interval", type=float, default=2.0, help="agent publish period (s)")
    up.add_argument("--sites", metavar="ID,ID", help="run only these sites")
    up.add_argument("--broker-listen", default="127.0.0.1:8080", metavar="HOST:PORT")
    up.add_argument(
        "--no-wan-emulation", action="store_true", help="plain loopback, no emulated RTT"
    )
    up.add_argument(
        "--etcd-members",
        type=int,
        default=1,
        metavar="N",
        help="embedded etcd as a raft cluster of N members (3 survives one member's loss)",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        help="etcd with TLS and auth, an etcd user per site, the broker on HTTPS",
    )
    up.add_argument(
        "--slurm", action="store_true", help="add site slurm-lab on a local Slurm (docs/slurm.md)"
    )
    up.add_argument(
        "--service",
        metavar="FILE",
        help="the demo's managed service (default: configs/services/example.yaml)",
    )
    up.add_argument(
        "--no-service", action="store_true", help="apply no managed service to the demo"
    )
    up.set_defaults(func=cmd_up)

    sites = sub.add_parser("sites", help="list the federation's sites")
    etcd_arg(sites)
    sites.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sites.add_argument(
        "--nodes", action="store_true", help="each declared node: its island and what it has free"
    )
    sites.set_defaults(func=cmd_sites)

    site = sub.add_parser("site", help="onboard or remove a site")
    site_sub = site.add_subparsers(dest="site_command", required=True, parser_class=CliParser)
    validate = site_sub.add_parser("validate", help="check site files; exit 2 on any problem")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.add_argument("--catalog", metavar="FILE")
    validate.set_defaults(func=cmd_site_validate)
    join = site_sub.add_parser("join", help="register (or update) sites from their files")
    join.add_argument("files", nargs="+", metavar="FILE")
    etcd_arg(join)
    join.add_argument(
        "--certs", metavar="DIR", help="CA issuing site credentials on a secure etcd "
        "(default: $CPN_CERTS, else cpn up's)"
    )  # fmt: skip
    join.set_defaults(func=cmd_site_join)
    leave = site_sub.add_parser("leave", help="cordon a site; remove it once drained")
    leave.add_argument("site", metavar="ID")
    leave.add_argument("--wait", type=float, default=0.0, help="seconds to wait for draining")
    etcd_arg(leave)
    leave.set_defaults(func=cmd_site_leave)

    certs = sub.add_parser("certs", help="a development CA and certificates (docs/auth.md)")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True, parser_class=CliParser)
    init = certs_sub.add_parser("init", help="the CA, etcd's and the broker's certificates")
    issue = certs_sub.add_parser("issue", help="one more certificate signed by the CA")
    issue.add_argument("name", help="file name and common name (an etcd user for a client)")
    issue.add_argument("--server", action="store_true", help="a server certificate")
    for p in (init, issue):
        p.add_argument("--certs", "--dir", dest="certs", metavar="DIR", help="default: cpn up's")
        p.add_argument("--host", action="append", metavar="HOST", help="a SAN (repeatable)")
    init.set_defaults(func=cmd_certs_init)
    issue.set_defaults(func=cmd_certs_issue)

    etcd = sub.add_parser("etcd", help="etcd administration")
    etcd_sub = etcd.add_subparsers(dest="etcd_command", required=True, parser_class=CliParser)
    secure = etcd_sub.add_parser(
        "secure", help="enable auth on an etcd with TLS; write root's and the broker's credentials"
    )
    secure.add_argument("--etcd", metavar="URL[,URL...]", help="https:// endpoints")
    secure.add_argument("--certs", metavar="DIR", help="the CA etcd trusts (cpn certs init)")
    secure.set_defaults(func=cmd_etcd_secure)

    agent = sub.add_parser("agent", help="run the perception agent of one site")
    agent.add_argument("--site", required=True, metavar="FILE", help="the site's YAML file")
    etcd_arg(agent)
    agent.add_argument("--listen", metavar="HOST:PORT", help="override agent.listen")
    agent.add_argument("--advertise", metavar="HOST:PORT", help="address peers should use")
    agent.add_argument("--probe-listen", metavar="HOST:PORT", help="probe responder address")
    agent.add_argument("--probe-advertise", metavar="HOST:PORT", help="address peers probe")
    agent.add_argument("--interval", type=float, help="override agent.interval_s")
    agent.add_argument("--probe-method", choices=METHODS, default="auto")
    agent.add_argument("--wan-emulated", action="store_true", help="label links as emulated")
    agent.add_argument("--service-url", action="append", metavar="NAME=URL")
    agent.set_defaults(func=cmd_agent)

    def broker_arg(
        p: argparse.ArgumentParser, outputs: tuple[str, ...] = ("table", "json")
    ) -> None:
        p.add_argument(
            "--broker", metavar="URL", help="broker API (default: $CPN_BROKER or cpn up's)"
        )
        p.add_argument("-o", "--output", choices=outputs, default="table")

    broker = sub.add_parser("broker", help="run a broker replica (API, placement, failover)")
    etcd_arg(broker)
    broker.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT")
    broker.add_argument("--config-dir", metavar="DIR", help="configs/ directory")
    broker.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate")
    broker.add_argument("--tls-key", metavar="FILE", help="the certificate's private key")
    broker.add_argument(
        "--wan-emulated",
        action="store_true",
        help="one-machine demo: send each client region's requests from its loopback address",
    )
    broker.set_defaults(func=cmd_broker)

    submit = sub.add_parser("submit", help="submit a job from a YAML file")
    submit.add_argument("file", metavar="FILE")
    broker_arg(submit)
    submit.set_defaults(func=cmd_submit)

    jobs = sub.add_parser("jobs", help="list jobs, newest first (all pages)")
    jobs.add_argument("--tenant", help="only this tenant's jobs")
    jobs.add_argument("--state", help="only jobs in these states (comma-separated)")
    jobs.add_argument("--site", help="only jobs placed on this site")
    jobs.add_argument(
        "--since", help="only jobs created since: RFC 3339 time, unix seconds, or '24h' ago"
    )
    jobs.add_argument("--all", action="store_true", help="archived jobs too (the history)")
    jobs.add_argument("--limit", type=int, metavar="N", help="show at most N jobs")
    broker_arg(jobs, ("table", "json", "jsonl"))
    jobs.set_defaults(func=cmd_jobs)

    describe = sub.add_parser(
        "describe", help="a job's placement, state and events; a workflow's DAG and steps"
    )
    describe.add_argument("job", metavar="JOB")
    broker_arg(describe)
    describe.set_defaults(func=cmd_describe)

    workflow = sub.add_parser("workflow", help="workflows: DAGs of steps (docs/workflows.md)")
    wf_sub = workflow.add_subparsers(dest="workflow_command", required=True, parser_class=CliParser)
    wf_list = wf_sub.add_parser("list", help="workflows, newest first")
    broker_arg(wf_list)
    wf_list.set_defaults(func=cmd_workflow)
    for name, text in (
        ("describe", "the DAG with each step's state"),
        ("cancel", "cancel every unfinished step (or one: --step)"),
        ("retry", "run the failed or cancelled steps again (or one: --step), with dependents"),
    ):
        p = wf_sub.add_parser(name, help=text)
        p.add_argument("workflow", metavar="NAME", help="the workflow's id, as submit printed it")
        if name != "describe":
            p.add_argument("--step", metavar="S", help="only this step")
        broker_arg(p)
        p.set_defaults(func=cmd_workflow)

    for action, text in (
        ("cancel", "cancel a job"),
        ("suspend", "stop a job, keep it"),
        ("resume", "re-queue a suspended job"),
    ):
        p = sub.add_parser(action, help=text)
        p.add_argument("job", metavar="JOB")
        broker_arg(p)
        p.set_defaults(func=cmd_job_action, action=action)

    logs = sub.add_parser("logs", help="a job's output from its site")
    logs.add_argument("job", metavar="JOB")
    logs.add_argument("-f", "--follow", action="store_true", help="stream until the run ends")
    broker_arg(logs)
    logs.set_defaults(func=cmd_logs)

    token = sub.add_parser("token", help="create, list or revoke API tokens (docs/auth.md)")
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
    create.add_argument(
        "--etcd",
        metavar="URL[,URL...]",
        help="write it straight into etcd (bootstrap: the first admin token)",
    )
    broker_arg(create, ("table", "json", "token"))
    create.set_defaults(func=cmd_token_create)
    tlist = token_sub.add_parser("list", help="the tokens you may see (never their secrets)")
    broker_arg(tlist)
    tlist.set_defaults(func=cmd_token_list)
    trevoke = token_sub.add_parser("revoke", help="revoke a token on every broker replica")
    trevoke.add_argument("id", metavar="ID")
    broker_arg(trevoke)
    trevoke.set_defaults(func=cmd_token_revoke)

    audit = sub.add_parser("audit", help="the audit log, newest first")
    audit.add_argument("--tenant", help="only this tenant's entries")
    audit.add_argument("--limit", type=int, default=100, metavar="N")
    broker_arg(audit)
    audit.set_defaults(func=cmd_audit)

    usage = sub.add_parser("usage", help="usage, cost, energy and carbon (docs/metering.md)")
    usage.add_argument("--tenant", help="only this tenant (a tenant's token: its own)")
    usage.add_argument("--site", help="only this site")
    usage.add_argument("--from", dest="from_", metavar="DATE", help="first UTC day, YYYY-MM-DD")
    usage.add_argument("--to", metavar="DATE", help="last UTC day, YYYY-MM-DD (inclusive)")
    usage.add_argument(
        "--by", metavar="DIM[,DIM]", help="group by tenant, site, model, day (default tenant)"
    )
    usage.add_argument("--month", metavar="YYYY-MM", help="chargeback: the month")
    usage.add_argument("--out", default=".", metavar="DIR", help="chargeback: where to write")
    usage.add_argument(
        "usage_command", nargs="?", choices=("chargeback",), help="chargeback: a month's CSV+PNG"
    )
    broker_arg(usage, ("table", "csv", "json"))
    usage.set_defaults(func=cmd_usage)

    alerts = sub.add_parser("alerts", help="alerts firing and resolved lately (docs/alerts.md)")
    alerts.add_argument("--state", choices=("firing", "resolved"), help="only these")
    alerts.add_argument("--config-dir", metavar="DIR", help="rules: the configs/ directory")
    alerts.add_argument(
        "alerts_command", nargs="?", choices=("rules",), help="rules: a Prometheus rules file"
    )
    broker_arg(alerts)
    alerts.set_defaults(func=cmd_alerts)

    tenant_cli.add_parsers(sub.add_parser, broker_arg)
    service_cli.add_parsers(sub.add_parser, broker_arg)
    load_cli.add_parsers(sub.add_parser, broker_arg)

    whoami = sub.add_parser("whoami", help="the token in use: its id, role and tenant")
    broker_arg(whoami)
    whoami.set_defaults(func=cmd_whoami)

    plan = sub.add_parser(
        "plan", help="solve a placement problem offline (docs/placement.md)", add_help=False
    )
    plan.add_argument("rest", nargs=argparse.REMAINDER)
    plan.set_defaults(func=cmd_plan)
    simulate = sub.add_parser(
        "simulate", help="capacity-planning simulation (docs/simulation.md)", add_help=False
    )
    simulate.add_argument("rest", nargs=argparse.REMAINDER)
    simulate.set_defaults(func=cmd_simulate)
    capacity = sub.add_parser(
        "plan-capacity",
        help="cheapest purchases that meet simulated targets (docs/simulation.md)",
        add_help=False,
    )
    capacity.add_argument("rest", nargs=argparse.REMAINDER)
    capacity.set_defaults(func=cmd_plan_capacity)
    return parser


# commands with their own parser: everything after the name is theirs, `--help` included
# (argparse's REMAINDER does not take an option that comes first)
_DELEGATED = {
    "plan": ("broker.plan.cli", "main"),
    "simulate": ("simulations.cli", "simulate_main"),
    "plan-capacity": ("simulations.cli", "plan_capacity_main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _DELEGATED:
        module, name = _DELEGATED[argv[0]]
        command = getattr(importlib.import_module(module), name)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        return int(command(argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        result = args.func(args)
        if isinstance(result, Coroutine):
            result = _run(result)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return int(result)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"cpn: error: {problem}", file=sys.stderr)
        return 2
    except ApiError as exc:
        print(f"cpn: error: {exc}", file=sys.stderr)
        return 2 if 400 <= exc.status < 500 else 1
    except (
        UsageError,
        ConfigFileError,
        CatalogError,
        NotJoined,
        AgentConflict,
        PkiError,
        ValueError,
    ) as exc:
        print(f"cpn: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `cpn jobs | head`: the reader has what it wanted; nothing more to say, no traceback
        # when the interpreter flushes stdout on its way out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (RegistryError, SitesError, OSError) as exc:
        print(f"cpn: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(coro: Coroutine[Any, Any, int]) -> int:
    async def main() -> int:
        # `kill -USR1 PID` prints every task's stack: what a stuck process is waiting for
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dump_tasks)
        return await coro

    try:  # uvloop where present: the broker's proxy and API get ~2x the requests per core
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=sys.stderr)
        awaitable: Any = task.get_coro()
        while awaitable is not None:  # follow the await chain down to what blocks
            frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
            if frame is None:
                print(f"    {awaitable!r}", file=sys.stderr)
                break
            print(
                f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}",
                file=sys.stderr,
            )
            awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
    sys.stderr.flush()
