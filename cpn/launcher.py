"""`cpn up`: a whole demo federation on this machine.

Starts (or uses) etcd, joins every site of configs/sites/, starts the WAN emulation (in this
process) and one `cpn agent` process per site, prints what runs where, and on SIGINT/SIGTERM
stops everything: agents first (they revoke their leases), then the emulation, then etcd.
Once the broker answers, it applies the demo's managed inference service
(configs/services/example.yaml, or --service FILE; --no-service: none) through the broker's
API, as `cpn service apply` would, and prints a line each time its ready replicas change.

The address plan with the WAN emulation (site number N owns 127.0.1.N, peers reach it through
the emulator's front 127.0.2.N) is cpn.wan_demo's; the demo service is cpn.service_demo's;
`cpn up --slurm` is cpn.slurm_demo's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from broker.state.auth import Role, create_token, new_token
from cpn import render, wan_demo
from cpn.certs import Issued, Pki
from cpn.client import ApiError, BrokerClient
from cpn.config import ConfigFileError, remove_context, save_context
from cpn.secure import agent_certificate, bootstrap, init_pki, site_credentials
from cpn.service_demo import follow, service_name
from cpn.state import clear_up_state, state_dir, write_up_state
from sites.emulation import wan
from sites.emulation.etcd_server import EmbeddedEtcd, EtcdCluster, free_port
from sites.kits.tasks import Supervisor
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites, read_yaml, site_files
from sites.model.errors import ConfigError, Problem, RegistryError
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
    secure: bool = False  # etcd with TLS and auth, per-site etcd users, HTTPS broker and agents
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
    tls: Issued | None = None  # the agent endpoint's server certificate (--secure)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None


CONTEXT = "up"  # the CLI config entry `cpn up` writes (cpn.config)
READY_WAIT_S = 60.0  # how long `cpn up` waits for the broker and every site before it says so


def try_hint(config_dir: Path) -> str:
    """What to try once the demo is up; its job file where these configs have it (a checkout's
    configs/ as a relative path from the repository, an installed package's as a full one)."""
    job = config_dir / "jobs" / "train-small.yaml"
    try:
        shown = str(job.resolve().relative_to(Path.cwd()))
    except ValueError:
        shown = str(job)
    return f"try: cpn sites; cpn submit {shown}; cpn jobs   (Ctrl-C stops everything)"


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
            if self.settings.secure:  # each agent's endpoint on HTTPS, named as peers reach it
                for plan in self.plans:
                    plan.tls = agent_certificate(
                        self.pki, plan.spec.id, [plan.listen, plan.advertise]
                    )
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
        specs = [p.spec for p in self.plans]
        self.emulator = wan_demo.emulator(self.settings.config_dir, specs)
        routes = await wan_demo.route(self.emulator, specs)
        for plan, r in zip(self.plans, routes, strict=True):
            plan.listen, plan.advertise = r.listen, r.advertise
            plan.probe_listen, plan.probe_advertise = r.probe_listen, r.probe_advertise
            plan.service_urls.update(r.service_urls)

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
            if plan.tls is not None:
                args += ["--tls-cert", str(plan.tls.cert_path), "--tls-key", str(plan.tls.key_path)]
            if self.settings.secure:  # peers' endpoints are verified against the run's CA
                args += ["--tls-ca", str(self.pki.ca_path), "--tls-crl", str(self.pki.crl_path)]
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
            "--state-dir", str(self.run_dir / "broker-state"),
        ]  # fmt: skip
        if self.settings.secure:
            args += ["--tls-cert", str(self.pki.directory / "broker.pem")]
            args += ["--tls-key", str(self.pki.directory / "broker-key.pem")]
            args += ["--agent-ca", str(self.pki.ca_path), "--agent-crl", str(self.pki.crl_path)]
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
                        print(
                            f"cpn up: ready, {len(wanted)} sites up. "
                            f"{try_hint(self.settings.config_dir)}",
                            flush=True,
                        )
                        return
                    missing = f"sites not up yet: {', '.join(sorted(wanted - up))}"
                await asyncio.sleep(0.5)
        print(
            f"cpn up: still waiting after {READY_WAIT_S:.0f} s for {missing} "
            f"(logs: {self.run_dir}). {try_hint(self.settings.config_dir)}",
            flush=True,
        )

    def _read_service(self) -> str | None:
        """The demo service's name, read before anything starts (a file that is not a
        mapping with a name is a ConfigError: exit 2)."""
        path = self.settings.service_path()
        return None if path is None else service_name(path)

    async def _demo_service(self, path: Path) -> None:
        """Apply the demo's service once the broker takes it, then report its ready replicas
        as they change (cpn.service_demo), until cancelled (a supervised task)."""
        assert self.service_name is not None
        ca = self.pki.ca_path if self.settings.secure else None
        regions = sorted({p.spec.region for p in self.plans}) if self.settings.only else None
        await follow(self.broker_url, self.token, ca, self.service_name, path, regions)

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
