"""A site's agent on HTTPS (`cpn agent --tls-cert`, as `cpn up --secure` starts it): the broker
reads a job's log from it only when it trusts the federation's CA (`cpn broker --agent-ca`),
refuses its certificate once revoked (`--agent-crl`) and reads it again once the running agent
serves a renewed one."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from cpn.certs import Pki
from cpn.rotation import held, renew, revoke
from cpn.secure import agent_certificate
from sites.emulation.etcd_server import free_port
from tests.broker.conftest import SITES, Federation
from tests.conftest import AUTH, run_cpn

pytestmark = pytest.mark.e2e  # starts agent and broker processes (tests/tiers.py)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=AUTH), timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def test_the_broker_reads_a_log_from_an_https_agent_only_with_the_federations_ca(
    make_federation: Callable[..., Federation], tmp_path: Path
) -> None:
    pki = Pki(tmp_path / "pki")
    pki.init()
    cert = agent_certificate(pki, "east-a", ["127.0.0.1:0"])
    # the fixture's broker is started without --agent-ca: it trusts the system's CAs only
    fed = make_federation({"east-a": SITES["east-a"]}, agents=False)
    fed.processes.start(
        "agent", "--site", str(fed.site_file("east-a")), "--etcd", fed.registry.url,
        "--catalog", str(fed.config_dir / "devices.yaml"), "--probe-method", "tcp-connect",
        "--tls-cert", str(cert.cert_path), "--tls-key", str(cert.key_path),
        name="agent-east-a", env={"CPN_STATE_DIR": str(fed.config_dir / "state")},
    )  # fmt: skip

    def site_up() -> bool:
        sites = json.loads(fed.get("/v1/sites")[1])["items"]
        return [s["state"] for s in sites] == ["up"]

    wait_until(site_up, "east-a up")
    job = fed.submit(name="tls-log", cpu=1)["id"]
    fed.wait_state(job, "SUCCEEDED")

    status, body = fed.request("GET", f"/v1/jobs/{job}/logs")
    assert status == 502 and body["error"]["code"] == "site_unreachable", body
    assert "certificate verify failed" in body["error"]["message"], body

    # a replica that trusts the federation's CA reads it (any replica serves the API)
    pki.write_crl()
    port = free_port()
    fed.processes.start(
        "broker", "--etcd", fed.registry.url, "--listen", f"127.0.0.1:{port}",
        "--config-dir", str(fed.config_dir), "--agent-ca", str(pki.ca_path),
        "--agent-crl", str(pki.crl_path),
        "--state-dir", str(tmp_path / "trusting-state"), name="broker-trusting",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return get(f"{url}/healthz")[0] == 200
        except OSError:
            return False

    wait_until(answers, "the trusting broker answers")
    status, text = get(f"{url}/v1/jobs/{job}/logs")  # its connection to the agent stays open
    assert status == 200 and "hello from east-a" in text, text
    # the agent's certificate revoked (a stolen key): the running broker loads the CRL within
    # a second, closes the connection it kept to the agent and refuses the certificate at its
    # next handshake; renewed, the running agent serves the new one and is read again
    [(old, _)] = revoke(pki, ["agent-east-a"])
    wait_until(
        lambda: "the CRL loaded (2 since start)" in fed.processes.log("broker-trusting"),
        "the broker loads the new CRL",
    )
    closed = f"serial {old.serial:#x}): its certificate is revoked"
    wait_until(lambda: closed in fed.processes.log("broker-trusting"), "the connection closed")
    status, text = get(f"{url}/v1/jobs/{job}/logs")
    assert status == 502 and "certificate revoked" in text, text
    renew(pki, next(c for c in held(pki) if c.name == "agent-east-a"))
    status, text = get(f"{url}/v1/jobs/{job}/logs")
    assert status == 200 and "hello from east-a" in text, text

    # a backup's copy goes to the HTTPS agent's data store only with the federation's CA
    # (docs/backup.md, "Copies at the sites"), and comes back from it checked
    backups = tmp_path / "backups"
    base = ("backup", "create", "--etcd", fed.registry.url, "--dir", str(backups), "--copies", "1")
    untrusted = run_cpn(*base, timeout=120)
    assert "certificate verify failed" in untrusted.stdout + untrusted.stderr, untrusted
    created = run_cpn(*base, "--agent-ca", str(pki.ca_path), "-o", "json", timeout=120)
    assert created.returncode == 0, created.stderr
    name = json.loads(created.stdout)["name"]
    store = fed.config_dir / "state" / "sites" / "east-a" / "data-store" / "backups"
    assert (store / f"{name}.db").exists(), sorted(store.glob("*")) if store.exists() else []
    fetched = run_cpn(
        "backup", "fetch", name, "--from", "east-a", "--etcd", fed.registry.url,
        "--dir", str(tmp_path / "new-host"), "--agent-ca", str(pki.ca_path), timeout=120,
    )  # fmt: skip
    assert fetched.returncode == 0 and "sha256 checked" in fetched.stdout, fetched
