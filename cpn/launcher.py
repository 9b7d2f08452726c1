"""`cpn up`: a whole demo federation on this machine.

Starts (or uses) etcd, joins every site of configs/sites/, starts the WAN emulation (in this
process) and one `cpn agent` process per site, prints what runs where, and on SIGINT/SIGTERM
stops everything: agents first (they revoke their leases), then the emulation, then etcd.
Once the broker answers, it applies the demo's managed inference service
(configs/services/example.yaml, or --service FILE; --no-service: none) through the broker's
API, as `cpn service apply` would, and prints a line each time its ready replicas change.

Address plan with the WAN emulation: site number N (1-based, in id order) owns 127.0.1.N; its
agent listens there and its probes leave from there; peers reach it through the emulator's front
127.0.2.N on the same port, which delays each direction by rtt/2 (docs/wan-emulation.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import yaml

from broker.model.regions import load_user_regions
from broker.state.auth import Role, create_token, new_token
from cpn import render
from cpn.certs import Pki
from cpn.client import ApiError, BrokerClient
from cpn.config import ConfigFileError, remove_context, save_context
from cpn.secure import bootstrap, init_pki, site_credentials
from cpn.state import clear_up_state, state_dir, write_up_state
from routing.decision.clients import load_clients
from sites.emulation import wan
from sites.emulation.etcd_server import EmbeddedEtcd, EtcdCluster, free_port
from sites.kits.tasks import Supervisor
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites, read_yaml, site_files
from sites.model.errors import ConfigError, Problem, RegistryError
from sites.model.latency import Endpoint, LatencyModel
from sites.model.spec import SiteSpec
from sites.registry.client import Registry
from sites.registry.security import BROKER_USER, ROOT_USER, EtcdTls, load_credentials

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchSettings:
    config_dir: Path
    etcd: str | None = None
    interval_s: float = 2.0
    wan_emulation: bool = True
    only: tuple[str, ...] = ()
    broker_listen: str = "127.0.0.1:8080"
    etcd_members: int = 1
    secure: bool = False  # etcd with TLS and auth, per-site etcd users, the broker on HTTPS
    demo_service: bool = True  # apply a managed service once the broker answers
    service_file: Path | None = None  # default: configs/services/example.yaml, when there

    def service_path(self) -> Path | None:
        """The demo service's file, or None: --no-service, or no example in the configs."""
        if not self.demo_service:
            return None
        if self.service_file is not None:
            return self.service_file
        example = self.config_dir / "services" / "example.yaml"
        return example if example.exists() else None


@dataclass
class SitePlan:
    spec: SiteSpec
    file: Path
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    probe_listen: str | None = None
    probe_advertise: str | None = None
    service_urls: dict[str, str] = field(default_factory=dict)
    credentials: Path | None = None  # the site's etcd credential file (--secure)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None


CLIENT = "client:"  # emulator node names of client regions


def node_ip(n: int) -> str:
    return f"127.0.1.{n}"


def front_ip(n: int) -> str:
    return f"127.0.2.{n}"


def endpoint_of(spec: SiteSpec) -> Endpoint:
    return Endpoint(lat=spec.coordinates.lat, lon=spec.coordinates.lon, zone=spec.latency_zone)


CONTEXT = "up"  # the CLI config entry `cpn up` writes (cpn.config)
READY_WAIT_S = 60.0  # how long `cpn up` waits for the broker and every site before it says so
TRY = (
    "try: cpn sites; cpn submit configs/jobs/train-small.yaml; cpn jobs   (Ctrl-C stops everything)"
)


def _report_failure(task: asyncio.Task[None]) -> None:
    """A one-shot helper task of `cpn up` that failed says so (its loops are supervised)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        print(f"cpn up: {task.get_name()} failed: {exc!r}", file=sys.stderr, flush=True)


class Launcher:
    def __init__(self, settings: LaunchSettings) -> None:
        self.settings = settings
        self.etcd: EmbeddedEtcd | EtcdCluster | None = None
        self.emulator: wan.WanEmulator | None = None
        self.plans: list[SitePlan] = []
        self.broker: subprocess.Popen[bytes] | None = None
        self.model_servers: list[subprocess.Popen[bytes]] = []
        self.broker_url = ""
        self.token: str | None = None
        self.token_id: str | None = None
        self.etcd_url = ""
        self.etcd_tls: EtcdTls | None = None  # root's, with --secure
        self.credentials: dict[str, Path] = {}  # etcd user -> credential file, with --secure
        self.run_dir = state_dir() / f"up-{os.getpid()}"
        self.pki = Pki(self.run_dir / "pki")
        self.broker_log = self.run_dir / "broker.log"
        self.service_name: str | None = None  # the demo's managed service, once read
        self._stop = asyncio.Event()

    def run(self) -> int:
        try:
            return wan.run(self._main())
        finally:
            self._reap()  # if the loop itself died, shutdown() may not have run to the end

    def _reap(self) -> None:
        """Last resort, without an event loop: no child process or etcd outlives `cpn up`."""
        children = [p.process for p in self.plans if p.process is not None]
        children += [self.broker] if self.broker is not None else []
        children += self.model_servers
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def load(self) -> list[SitePlan]:
        cfg = self.settings.config_dir
        catalog = DeviceCatalog.load(cfg / "devices.yaml")
        files = site_files(cfg / "sites")
        if not files:
            raise ConfigError([Problem(str(cfg / "sites"), "", "no site files (*.yaml) found")])
        specs = load_sites(files, catalog)
        by_id = {spec.id: path for spec, path in zip(specs, files, strict=True)}
        unknown = sorted(set(self.settings.only) - set(by_id))
        if unknown:
            raise ConfigError([Problem("--sites", "", f"unknown site(s): {', '.join(unknown)}")])
        wanted = self.settings.only or tuple(sorted(by_id))
        if len(wanted) > 250:
            raise ConfigError([Problem(str(cfg), "", "the demo address plan holds 250 sites")])
        specs_by_id = {s.id: s for s in specs}
        return [SitePlan(spec=specs_by_id[i], file=by_id[i]) for i in sorted(wanted)]

    async def _main(self) -> int:
        self.plans = self.load()
        self.service_name = self._read_service()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            url = self.settings.etcd or self._start_etcd()
            self.etcd_url = url
            if self.settings.secure:
                self.credentials = await bootstrap(url, self.pki)
                self.etcd_tls = load_credentials(self.credentials[ROOT_USER]).tls()
            async with Registry.from_urls(url, tls=self.etcd_tls) as registry:
                for plan in self.plans:
                    await registry.join(plan.spec)
                    if self.settings.secure:
                        plan.credentials = await site_credentials(registry, self.pki, plan.spec)
                await self._make_token(registry)
            if self.settings.wan_emulation:
                await self._start_wan()
            else:
                for plan in self.plans:
                    plan.listen = f"127.0.0.1:{free_port()}"
            self._start_model_servers()
            self._start_agents(url)
            self._start_broker(url)
            write_up_state(
                {
                    "pid": os.getpid(),
                    "etcd": url,
                    "broker": self.broker_url,
                    "token": self.token,
                    **(
                        {
                            "etcd_credentials": str(self.credentials[ROOT_USER]),
                            "ca": str(self.pki.ca_path),
                        }
                        if self.settings.secure
                        else {}
                    ),
                    "started_at": time.time(),
                    "sites": {p.spec.id: p.advertise or p.listen for p in self.plans},
                }
            )
            try:
                ca = str(self.pki.ca_path) if self.settings.secure else None
                where = save_context(CONTEXT, self.broker_url, self.token, ca=ca)
                print(f"cpn up: the CLI's config {where} has the demo's admin token", flush=True)
            except (OSError, ConfigFileError) as exc:
                print(f"cpn up: could not write the CLI's config: {exc}", flush=True)
            print(self.describe(url), flush=True)
            supervisor = Supervisor(owner="cpn up")
            supervisor.spawn("process monitor", self._supervise)
            ready = asyncio.create_task(self._announce_ready(), name="cpn up ready")
            ready.add_done_callback(_report_failure)
            service = self.settings.service_path()
            if service is not None and self.service_name is not None:
                supervisor.spawn("demo service", lambda: self._demo_service(service))
            stop = asyncio.create_task(self._stop.wait(), name="cpn up stop")
            failed = asyncio.create_task(supervisor.failed.wait(), name="cpn up failed")
            try:
                await asyncio.wait((stop, failed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (stop, failed, ready):
                    task.cancel()
                await asyncio.gather(stop, failed, ready, return_exceptions=True)
                await supervisor.stop()
            if supervisor.fatal is not None:
                print(f"cpn up: {supervisor.fatal.error}; stopping", file=sys.stderr, flush=True)
                return 1
        finally:
            await self.shutdown()
        return 0

    async def _make_token(self, registry: Registry) -> None:
        """The demo's admin token, written straight into etcd (a bootstrap, as an operator
        with etcd access makes the first one); revoked when `cpn up` stops."""
        record, self.token = new_token(
            role=Role.admin,
            tenant=None,
            now=time.time(),
            created_by="cpn up",
            description=f"cpn up (pid {os.getpid()})",
        )
        await create_token(registry, record)
        self.token_id = record.id

    async def _revoke_token(self) -> None:
        if self.token_id is None or self.etcd is not None:
            return  # an embedded etcd goes with its data
        try:
            async with Registry.from_urls(self.etcd_url, tls=self.etcd_tls) as registry:
                await registry.commit(guards=[], deletes=[keys.token(self.token_id)])
        except RegistryError as exc:
            print(f"cpn up: could not revoke the demo token: {exc}", flush=True)

    def _start_etcd(self) -> str:
        """One embedded member, or with --etcd-members N a raft cluster of N (every agent
        and the broker get every endpoint and fail over between them); with --secure, on TLS
        (clients and peers) with certificates from a CA made for this run."""
        if self.settings.etcd_members > 1:
            tls = init_pki(self.pki) if self.settings.secure else None
            self.etcd = EtcdCluster(self.settings.etcd_members, tls=tls)
        elif self.settings.secure:
            self.etcd = EmbeddedEtcd(tls=init_pki(self.pki))
        else:
            self.etcd = EmbeddedEtcd()
        return self.etcd.start()

    async def _start_wan(self) -> None:
        latency = LatencyModel.from_dir(self.settings.config_dir / "latency")
        endpoints = {p.spec.id: endpoint_of(p.spec) for p in self.plans}

        def rtt(src: str, dst: str) -> float:
            return latency.rtt_ms(endpoints[src], endpoints[dst])

        ips = {node_ip(n): p.spec.id for n, p in enumerate(self.plans, start=1)}
        client_rtt, sources = self._client_rtts(latency, rtt)
        # client regions get their own node names: "frankfurt" is both a site and a client region
        ips.update({ip: CLIENT + region for region, ip in sources.items()})

        def path_rtt(src: str, dst: str) -> float:
            if src.startswith(CLIENT):  # a client region reaches a site through its ingress
                return client_rtt[src.removeprefix(CLIENT)].get(dst, 0.0)
            return rtt(src, dst)

        self.emulator = wan.WanEmulator(node_of_ip=ips, rtt_ms=path_rtt)
        for n, plan in enumerate(self.plans, start=1):
            port = free_port(node_ip(n))
            plan.listen = f"{node_ip(n)}:{port}"
            host, fport = await self.emulator.add_route(
                front=(front_ip(n), port), backend=(node_ip(n), port), node=plan.spec.id
            )
            plan.advertise = f"{host}:{fport}"
            pport = free_port(node_ip(n))
            plan.probe_listen = f"{node_ip(n)}:{pport}"
            phost, pfport = await self.emulator.add_route(
                front=(front_ip(n), pport), backend=(node_ip(n), pport), node=plan.spec.id
            )
            plan.probe_advertise = f"{phost}:{pfport}"
            for svc in plan.spec.services:
                parts = urlsplit(svc.url)
                backend = (parts.hostname or "127.0.0.1", parts.port or 80)
                fhost, fport = await self.emulator.add_route(
                    front=(front_ip(n), backend[1]), backend=backend, node=plan.spec.id
                )
                plan.service_urls[svc.name] = urlunsplit(parts._replace(netloc=f"{fhost}:{fport}"))

    def _client_rtts(
        self, latency: LatencyModel, rtt: Callable[[str, str], float]
    ) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
        """Client region -> site -> RTT (the best ingress site's access RTT plus its WAN RTT),
        and client region -> the loopback address it sends from (its 127.0.3.n/32 in
        configs/clients.yaml), as the broker's proxy does on its behalf when the WAN is emulated.
        """
        path = self.settings.config_dir / "clients.yaml"
        if not path.exists():
            return {}, {}
        regions = load_user_regions(self.settings.config_dir / "regions.yaml")
        specs = {p.spec.id: p.spec for p in self.plans}
        clients = load_clients(path, user_regions=regions)
        out: dict[str, dict[str, float]] = {}
        for region in clients.regions:
            attach = {
                site: ms
                for site, ms in clients.attach_rtt_ms(region, specs, regions, latency).items()
                if site in specs
            }
            out[region] = {
                site: min(
                    (ms + (0.0 if a == site else rtt(a, site)) for a, ms in attach.items()),
                    default=0.0,
                )
                for site in specs
            }
        return out, clients.loopback_sources()

    def _start_model_servers(self) -> None:
        """The STAND-IN model servers behind the demo's services (configs/standin.yaml)."""
        path = self.settings.config_dir / "standin.yaml"
        table = (read_yaml(path) or {}) if path.exists() else {}
        models, default = table.get("models", {}), table.get("default", {})
        # "site/service" -> the environment variable of the key that stand-in requires
        api_keys = table.get("api_keys", {})
        for n, plan in enumerate(self.plans, start=1):
            for svc in plan.spec.services:
                parts = urlsplit(svc.url)
                timing = {"median_ms": 300, "p99_ms": 1000, **default, **models.get(svc.model, {})}
                args = [
                    sys.executable, "-m", "routing.standin.server",
                    "--listen", f"{parts.hostname}:{parts.port}",
                    "--name", f"{plan.spec.id}/{svc.name}",
                    "--median-ms", str(timing["median_ms"]),
                    "--p99-ms", str(timing["p99_ms"]),
                    "--max-concurrency", str(svc.max_concurrency),
                    "--seed", str(n),
                ]  # fmt: skip
                if key_env := api_keys.get(f"{plan.spec.id}/{svc.name}"):
                    args += ["--api-key-env", str(key_env)]
                log_path = self.run_dir / f"model-{plan.spec.id}-{svc.name}.log"
                with open(log_path, "ab") as logfile:
                    self.model_servers.append(
                        subprocess.Popen(
                            args, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                        )
                    )

    def _start_agents(self, url: str) -> None:
        for plan in self.plans:
            args = [
                sys.executable, "-m", "cpn", "agent",
                "--site", str(plan.file),
                "--catalog", str(self.settings.config_dir / "devices.yaml"),
                *self._etcd_args(url, plan.credentials),
                "--listen", plan.listen,
                "--interval", str(self.settings.interval_s),
            ]  # fmt: skip
            if plan.advertise:
                args += ["--advertise", plan.advertise, "--wan-emulated"]
            if plan.probe_listen and plan.probe_advertise:
                args += ["--probe-listen", plan.probe_listen]
                args += ["--probe-advertise", plan.probe_advertise]
            for name, svc_url in plan.service_urls.items():
                args += ["--service-url", f"{name}={svc_url}"]
            plan.log_path = self.run_dir / f"agent-{plan.spec.id}.log"
            # the jobs the demo's agents run find cpn's own Python first on PATH, so that a
            # job's `python` (a managed service's stand-in model server) is the one with
            # cpn's packages, as it would be in a site's own environment
            env = dict(os.environ)
            env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
            with open(plan.log_path, "ab") as logfile:
                plan.process = subprocess.Popen(
                    args,
                    stdout=logfile,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                )

    def _start_broker(self, url: str) -> None:
        host, port = self.settings.broker_listen.rsplit(":", 1)
        if port == "0":  # any free port
            port = str(free_port(host))
        try:
            with socket.socket() as probe:
                probe.bind((host, int(port)))
        except OSError:
            port = str(free_port(host))
            log.warning(
                "%s is taken; the broker listens on port %s", self.settings.broker_listen, port
            )
        listen = f"{host}:{port}"
        self.broker_url = f"{'https' if self.settings.secure else 'http'}://{listen}"
        args = [
            sys.executable, "-m", "cpn", "broker",
            *self._etcd_args(url, self.credentials.get(BROKER_USER)),
            "--listen", listen,
            "--config-dir", str(self.settings.config_dir),
        ]  # fmt: skip
        if self.settings.secure:
            args += ["--tls-cert", str(self.pki.directory / "broker.pem")]
            args += ["--tls-key", str(self.pki.directory / "broker-key.pem")]
        if self.emulator is not None:
            args.append("--wan-emulated")
        with open(self.broker_log, "ab") as logfile:
            self.broker = subprocess.Popen(
                args, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    @staticmethod
    def _etcd_args(url: str, credentials: Path | None) -> list[str]:
        if credentials is None:
            return ["--etcd", url]
        return ["--etcd-credentials", str(credentials)]

    def describe(self, url: str) -> str:
        mode = "WAN EMULATED (user-space delay, one machine)" if self.emulator else "plain loopback"
        etcd = f"embedded etcd {url} (data {self.etcd.data_dir})" if self.etcd else f"etcd {url}"
        rows = [
            [
                p.spec.id,
                p.spec.region,
                str(p.process.pid if p.process else "-"),
                p.listen,
                p.advertise or "-",
                ", ".join(f"{k}={v}" for k, v in p.service_urls.items())
                or ", ".join(s.name for s in p.spec.services)
                or "-",
            ]
            for p in self.plans
        ]
        table = render.table(["SITE", "REGION", "PID", "LISTEN", "REACHED AT", "SERVICES"], rows)
        broker = f"broker {self.broker_url} (pid {self.broker.pid if self.broker else '-'})"
        name = self.service_name
        service = (
            f"service: {name} ({self.settings.service_path()}), autoscaled; "
            f"try: cpn services; cpn load {name} --day 10m\n"
            if name
            else ""
        )
        return (
            f"cpn up: {len(self.plans)} sites, {etcd}\n"
            f"{broker}\n"
            f"dashboard: {self.broker_url}/#token={self.token or ''}\n"
            f"network: {mode}\n"
            f"logs: {self.run_dir}\n{table}\n{service}"
            f"starting: the hint to try comes once the broker answers (up to {READY_WAIT_S:.0f} s)"
        )

    async def _announce_ready(self) -> None:
        """Print what to try once the broker answers and has heard from every site (a
        `cpn submit` before that was "broker unreachable", and `cpn sites` showed every site
        down); after READY_WAIT_S, what is still missing."""
        assert self.broker_url is not None
        ca = str(self.pki.ca_path) if self.settings.secure else None
        wanted = {p.spec.id for p in self.plans}
        missing = "the broker's first answer"
        deadline = time.monotonic() + READY_WAIT_S
        async with BrokerClient(self.broker_url, self.token, ca=ca) as client:
            while time.monotonic() < deadline:
                try:
                    async with asyncio.timeout(5):
                        up = {
                            row.get("id")
                            async for page in client.pages("/v1/sites", {}, limit=None)
                            for row in page
                            if row.get("state") == "up"
                        }
                except (ApiError, TimeoutError) as exc:
                    missing = f"the broker's first answer ({exc or 'no answer within 5 s'})"
                else:
                    if wanted <= up:
                        print(f"cpn up: ready, {len(wanted)} sites up. {TRY}", flush=True)
                        return
                    missing = f"sites not up yet: {', '.join(sorted(wanted - up))}"
                await asyncio.sleep(0.5)
        print(
            f"cpn up: still waiting after {READY_WAIT_S:.0f} s for {missing} "
            f"(logs: {self.run_dir}). {TRY}",
            flush=True,
        )

    def _read_service(self) -> str | None:
        """The demo service's name, read before anything starts (a file that is not a
        mapping with a name is a ConfigError: exit 2)."""
        path = self.settings.service_path()
        if path is None:
            return None
        doc = read_yaml(path)  # ConfigFileError: exit 2 with one line
        name = doc.get("name") if isinstance(doc, dict) else None
        if not isinstance(name, str) or not name:
            raise ConfigError([Problem(str(path), "name", "a service file needs a name")])
        return name

    def _service_text(self, path: Path) -> str:
        """The file as sent. With --sites, a service that names no `regions` of its own may
        run in the regions of the sites that run: the broker refuses a replica whose allowed
        regions (a client region's sovereignty list) name a region no running site is in."""
        text = path.read_text()
        doc = read_yaml(path)
        if not self.settings.only or not isinstance(doc, dict) or "regions" in doc:
            return text
        doc["regions"] = sorted({p.spec.region for p in self.plans})
        return str(yaml.safe_dump(doc, sort_keys=False))

    async def _demo_service(self, path: Path) -> None:
        """Apply the demo's service once the broker takes it (PUT /v1/services/<name>, retried
        while the broker starts), then report its ready replicas as they change, until
        cancelled (a supervised task). A file the broker refuses is reported, not fatal: the
        rest of the demo runs on."""
        name = self.service_name
        text = self._service_text(path)
        context: ssl.SSLContext | bool = True
        if self.settings.secure:
            context = ssl.create_default_context(cafile=str(self.pki.ca_path))
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        url = f"{self.broker_url}/v1/services/{name}"
        async with aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=context),
            timeout=aiohttp.ClientTimeout(total=10),
        ) as http:
            if not await self._apply_service(http, url, path, text):
                await asyncio.Event().wait()  # nothing to follow; cancelled with the demo
            shown: tuple[int, int] | None = None
            while True:
                await asyncio.sleep(2.0)
                try:
                    async with http.get(url) as resp:
                        view = await resp.json() if resp.status == 200 else None
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    continue  # the broker restarting: the supervisor reports that
                if view is None:
                    continue
                counts = (
                    sum(r["ready"] for r in view["regions"]),
                    sum(r["desired"] for r in view["regions"]),
                )
                if counts != shown:
                    shown = counts
                    print(
                        f"cpn up: service {name}: {counts[0]}/{counts[1]} replicas ready",
                        flush=True,
                    )

    async def _apply_service(
        self, http: aiohttp.ClientSession, url: str, path: Path, text: str
    ) -> bool:
        """PUT the service file until the broker takes it (True) or refuses it (False)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                async with http.put(
                    url, data=text.encode(), headers={"Content-Type": "application/yaml"}
                ) as resp:
                    body = await resp.json(content_type=None)
                    if resp.status in (200, 201):
                        print(
                            f"cpn up: service {body['name']} applied from {path}; its replicas "
                            "follow (cpn services)",
                            flush=True,
                        )
                        return True
                    if 400 <= resp.status < 500:
                        err = body.get("error", {}) if isinstance(body, dict) else {}
                        print(
                            f"cpn up: the broker refused service file {path}: "
                            f"{err.get('message', resp.status)} (field {err.get('field')})",
                            file=sys.stderr,
                            flush=True,
                        )
                        return False
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                print(
                    f"cpn up: service file {path} not applied: the broker did not take it "
                    "within 120 s",
                    file=sys.stderr,
                    flush=True,
                )
                return False
            await asyncio.sleep(0.5)

    async def _supervise(self) -> None:
        """Report children that exit, until cancelled (a supervised task: sites.kits.tasks)."""
        reported: set[str] = set()
        while True:
            if (
                self.broker is not None
                and self.broker.poll() is not None
                and "broker" not in reported
            ):
                reported.add("broker")
                print(
                    f"cpn up: the broker exited with {self.broker.returncode} "
                    f"(log {self.broker_log})",
                    file=sys.stderr,
                    flush=True,
                )
            for plan in self.plans:
                proc = plan.process
                if proc is not None and proc.poll() is not None and plan.spec.id not in reported:
                    reported.add(plan.spec.id)
                    print(
                        f"cpn up: agent of {plan.spec.id} exited with {proc.returncode} "
                        f"(log {plan.log_path}); its site goes down",
                        file=sys.stderr,
                        flush=True,
                    )
            await asyncio.sleep(0.5)

    async def shutdown(self) -> None:
        procs = [
            p.process for p in self.plans if p.process is not None and p.process.poll() is None
        ]
        if self.broker is not None and self.broker.poll() is None:
            procs.append(self.broker)
        procs += [m for m in self.model_servers if m.poll() is None]
        if self.emulator is not None:
            self.emulator.stopping()  # peers' probes to agents already gone: no warning each
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.emulator is not None:
            await self.emulator.close()
            self.emulator = None
        await self._revoke_token()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        if self.token is not None:
            try:
                remove_context(CONTEXT, url=self.broker_url)
            except OSError:
                pass
        clear_up_state(os.getpid())
        print("cpn up: stopped", flush=True)
