"""A broker process with inference routing on (the demo's clients.yaml) and no site joined.

The API tests need every route the broker can serve, /v1/route and /v1/infer included, and no
agents: without sites the router answers 404 or 400, and jobs stay PENDING.
"""

from __future__ import annotations

import json
import shutil
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from sites.emulation.etcd_server import free_port
from tests.broker.conftest import BROKER_SETTINGS
from tests.conftest import AUTH, CONFIGS, Processes


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str
    server_timing: str | None = None

    def json(self) -> dict[str, object]:
        data = json.loads(self.body)
        assert isinstance(data, dict), data
        return data

    def error(self) -> tuple[str, object]:
        """(code, field) of the JSON error body."""
        err = self.json()["error"]
        assert isinstance(err, dict) and set(err) == {"code", "message", "field"}, err
        return err["code"], err["field"]


@dataclass(frozen=True)
class ApiBroker:
    url: str
    token: str | None = None  # an Authorization header value; None: the tests' admin token
    context: ssl.SSLContext | None = None  # trusts the CA of an https:// broker

    def as_(self, authorization: str) -> ApiBroker:
        """The same broker, called with this Authorization header ("" for none)."""
        return ApiBroker(self.url, authorization, self.context)

    def call(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> Reply:
        headers = dict(AUTH) if self.token is None else {}
        if self.token:
            headers["Authorization"] = self.token
        if content_type is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.context) as resp:
                return Reply(
                    resp.status,
                    resp.read(),
                    resp.headers.get("Content-Type", ""),
                    resp.headers.get("Server-Timing"),
                )
        except urllib.error.HTTPError as exc:
            return Reply(
                exc.code,
                exc.read(),
                exc.headers.get("Content-Type", ""),
                exc.headers.get("Server-Timing"),
            )

    def post_json(self, path: str, body: object) -> Reply:
        return self.call("POST", path, json.dumps(body).encode(), "application/json")


def start_api_broker(
    etcd_url: str,
    processes: Processes,
    root: Path,
    settings: dict[str, object] | None = None,
    *,
    leader: bool = True,
    etcd_args: tuple[str, ...] | None = None,
    tls: tuple[Path, Path, Path] | None = None,
) -> ApiBroker:
    """A broker process; waits until it serves (and, with `leader`, leads). `etcd_args`
    replace `--etcd URL` (a secure etcd's `--etcd-credentials FILE`); `tls` is (certificate,
    key, CA): the broker serves HTTPS and the client trusts the CA."""
    cfg = root / "configs"
    if not cfg.exists():
        shutil.copytree(CONFIGS, cfg)
    (cfg / "broker.yaml").write_text(yaml.safe_dump({**BROKER_SETTINGS, **(settings or {})}))
    port = free_port()
    name = f"api-broker-{len(processes.procs)}"
    extra: list[str] = []
    context = None
    if tls is not None:
        extra = ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        context = ssl.create_default_context(cafile=str(tls[2]))
    proc = processes.start(
        "broker", *(etcd_args or ("--etcd", etcd_url)), "--listen", f"127.0.0.1:{port}",
        "--config-dir", str(cfg), "--state-dir", str(root / f"{name}-state"), *extra,
        name=name,
    )  # fmt: skip
    scheme = "https" if tls else "http"
    broker = ApiBroker(f"{scheme}://127.0.0.1:{port}", context=context)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("broker exited: " + processes.log(name))
        try:
            reply = broker.call("GET", "/healthz")
            if reply.status == 200 and (reply.json()["leader"] or not leader):
                return broker
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError("broker did not become leader: " + processes.log(name))
