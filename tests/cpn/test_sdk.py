"""The Python SDK (cpn.sdk) without a federation: its names, the connection it finds as the CLI
does, the error tree from real HTTP answers (a small aiohttp server on loopback standing in
for the broker's error paths), and bad input refused before anything is sent.
(tests/cpn/test_sdk_e2e.py drives it against a real broker.)"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

import cpn
import cpn.sdk
from cpn.config import save_context
from cpn.sdk import errors
from cpn.sdk.connection import NoBroker, resolve
from sites.emulation.etcd_server import free_port
from tests.conftest import ADMIN_TOKEN, REPO

# -- names ---------------------------------------------------------------------------------


def test_cpn_exports_the_sdk_names_and_each_resolves() -> None:
    assert sorted(cpn.__all__) == sorted(cpn.sdk.__all__) == sorted(cpn.sdk.MODULES)
    for name in cpn.__all__:
        assert getattr(cpn, name) is getattr(cpn.sdk, name), name
    assert cpn.Client.__name__ == "Client" and cpn.JobState.RUNNING.value == "RUNNING"
    assert {"Client", "AsyncClient", "NotFound"} <= set(dir(cpn)) & set(dir(cpn.sdk))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = cpn.Nope  # type: ignore[attr-defined]


def test_the_tree() -> None:
    api = (errors.Invalid, errors.Unauthorized, errors.Forbidden, errors.NotFound)
    api += (errors.Conflict, errors.Gone, errors.RateLimited, errors.ServerError)
    for cls in api:
        assert issubclass(cls, errors.ApiError) and issubclass(cls, errors.CpnError)
    assert issubclass(errors.TransportError, ConnectionError)
    assert issubclass(errors.WaitTimeout, TimeoutError)
    for cls in (errors.ConfigError, errors.WaitTimeout, errors.JobEnded, errors.UnexpectedAnswer):
        assert issubclass(cls, errors.CpnError) and not issubclass(cls, errors.ApiError)
    assert issubclass(NoBroker, errors.ConfigError)


@pytest.mark.e2e  # a fresh interpreter
def test_the_cli_starts_without_the_sdks_client_or_models() -> None:
    probe = (
        "import sys; from cpn import cli; cli.build_parser('jobs'); import cpn; "
        "print(sorted(m for m in sys.modules if m.startswith('cpn.sdk')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # the errors and where the broker is, not the client, its models or its HTTP
    assert done.stdout.strip() == "['cpn.sdk', 'cpn.sdk.connection', 'cpn.sdk.errors']"
    probe = "import sys, cpn; print(sorted(m for m in sys.modules if m.startswith('cpn.sdk')))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout


# -- errors from answers -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, errors.Invalid),
        (401, errors.Unauthorized),
        (403, errors.Forbidden),
        (404, errors.NotFound),
        (409, errors.Conflict),
        (410, errors.Gone),
        (413, errors.Invalid),
        (415, errors.Invalid),
        (422, errors.Invalid),
        (429, errors.RateLimited),
        (500, errors.ServerError),
        (503, errors.ServerError),
        (418, errors.ApiError),
    ],
)
def test_an_error_body_becomes_its_class(status: int, cls: type[errors.ApiError]) -> None:
    body = {"error": {"code": "invalid", "message": "cpu must be >= 0", "field": "cpu"}}
    exc = errors.api_error(status, body, {"X-Request-Id": "r-1", "Retry-After": "3"})
    assert type(exc) is cls
    assert (exc.status, exc.code, exc.field, exc.request_id) == (status, "invalid", "cpu", "r-1")
    assert str(exc) == "cpu must be >= 0 (field: cpu)"  # as the CLI prints it
    if isinstance(exc, errors.RateLimited):
        assert exc.retry_after_s == 3.0


def test_an_answer_not_in_the_apis_shape_still_says_its_status() -> None:
    exc = errors.api_error(502, "<html>bad gateway</html>", {"Retry-After": "soon"})
    assert isinstance(exc, errors.ServerError)
    assert (str(exc), exc.field, exc.code) == ("HTTP 502", None, "error")
    limited = errors.api_error(429, {"error": "nope"}, {"Retry-After": "Wed, 21 Oct 2015"})
    assert isinstance(limited, errors.RateLimited) and limited.retry_after_s is None


# -- where the broker is -------------------------------------------------------------------


@pytest.fixture
def no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No $CPN_BROKER, $CPN_TOKEN, $CPN_CA, config file or running `cpn up`."""
    for name in ("CPN_BROKER", "CPN_TOKEN", "CPN_CA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CPN_CONFIG", str(tmp_path / "config.yaml"))
    monkeypatch.setenv("CPN_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


def test_the_connection_is_found_as_the_cli_finds_it(
    no_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(NoBroker, match="no broker: pass --broker URL"):
        resolve()
    save_context("prod", "https://prod.example:8443/", "cpn_prod", ca="/etc/cpn/ca.pem")
    found = resolve()
    assert (found.url, found.token, found.ca) == (
        "https://prod.example:8443",
        "cpn_prod",
        "/etc/cpn/ca.pem",
    )
    assert "cpn_prod" not in repr(found)  # a token is never printed
    monkeypatch.setenv("CPN_BROKER", "http://127.0.0.1:9/")
    monkeypatch.setenv("CPN_TOKEN", "cpn_env")
    found = resolve()
    assert (found.url, found.token, found.ca) == ("http://127.0.0.1:9", "cpn_env", None)
    # arguments first
    assert resolve("https://prod.example:8443", token="cpn_arg").token == "cpn_arg"
    with pytest.raises(errors.ConfigError, match="expected http:// or https://"):
        resolve("prod.example:8443")


def test_a_config_file_others_may_read_is_a_config_error(no_config: Path) -> None:
    path = no_config / "config.yaml"
    path.write_text("current: x\nbrokers: {x: {url: 'http://127.0.0.1:9'}}\n")
    path.chmod(0o644)
    with pytest.raises(errors.ConfigError, match="readable by others"):
        cpn.Client()


# -- real HTTP, a stand-in for the broker's error paths ------------------------------------


async def _answers(request: web.Request) -> web.StreamResponse:
    kind = request.match_info["kind"]
    if kind == "limited":
        body = {"error": {"code": "rate_limited", "message": "slow down", "field": None}}
        return web.json_response(body, status=429, headers={"Retry-After": "2"})
    if kind == "html":
        return web.Response(text="<html>bad gateway</html>", status=502, content_type="text/html")
    if kind == "notjson":
        return web.Response(text="hello", status=200)
    if kind == "notajob":
        return web.json_response({"id": "notajob", "state": "SLEEPING"})
    raise web.HTTPNotFound


@pytest.fixture
async def standin() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/v1/jobs/{kind}", _answers)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_answers_that_are_not_the_apis_become_errors_too(standin: str) -> None:
    async with cpn.AsyncClient(standin, token=ADMIN_TOKEN) as client:
        with pytest.raises(errors.RateLimited) as limited:
            await client.jobs.get("limited")
        assert limited.value.retry_after_s == 2.0 and limited.value.code == "rate_limited"
        with pytest.raises(errors.ServerError, match="HTTP 502"):
            await client.jobs.get("html")
        with pytest.raises(errors.UnexpectedAnswer, match=r"answer \(200\) is not JSON"):
            await client.jobs.get("notjson")
        with pytest.raises(errors.UnexpectedAnswer, match="not a JobRecord: spec: Field required"):
            await client.jobs.get("notajob")


async def test_an_async_client_stays_in_the_loop_it_first_ran_in(standin: str) -> None:
    async with cpn.AsyncClient(standin, token=ADMIN_TOKEN) as client:
        with pytest.raises(errors.NotFound):
            await client.jobs.get("nothing")  # its connections now belong to this loop

        def elsewhere() -> BaseException | None:
            try:
                asyncio.run(client.jobs.get("nothing"))
            except errors.CpnError as exc:
                return exc
            return None

        got = await asyncio.to_thread(elsewhere)
        assert isinstance(got, errors.CpnError) and "another event loop" in str(got)


async def test_a_broker_that_is_not_there_is_a_transport_error(no_config: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with cpn.AsyncClient(url, connect_timeout_s=2) as client:
        with pytest.raises(errors.TransportError, match="is unreachable") as down:
            await client.jobs.get("j-1")
        assert isinstance(down.value, ConnectionError)
    with cpn.Client(url) as sync, pytest.raises(errors.TransportError):
        sync.whoami()


# -- bad input, refused before it is sent --------------------------------------------------

BAD: list[tuple[str, Callable[[Any], Any], str]] = [
    ("an empty job id", lambda c: c.jobs.get(""), "job"),
    ("a page of none", lambda c: c.jobs.page(limit=0), "limit"),
    ("an unknown state", lambda c: c.jobs.page(state="sleeping"), "state"),
    ("a wait for an unknown state", lambda c: c.jobs.wait("j-1", states=["DONE"]), "states"),
    ("a negative timeout", lambda c: c.jobs.wait("j-1", timeout=-1), "timeout"),
    ("a poll of no time", lambda c: c.jobs.wait("j-1", poll_s=0), "poll_s"),
    ("a spec of the wrong type", lambda c: c.jobs.submit(42), "spec"),
    ("a service without a name", lambda c: c.services.apply({"tenant": "t1"}), "name"),
    ("a service file not YAML", lambda c: c.services.apply("name: [x"), "spec"),
    ("an empty workflow id", lambda c: c.workflows.get(""), "workflow"),
    ("a dataset without its owner", lambda c: c.datasets.get("corpus"), "dataset"),
    ("a dataset's version to describe", lambda c: c.datasets.get("t1/corpus@2"), "dataset"),
    ("a manifest of no version", lambda c: c.datasets.manifest("t1/corpus"), "dataset"),
    ("a replica nowhere", lambda c: c.datasets.replicate("t1/corpus"), "site"),
    ("a share of a string", lambda c: c.datasets.share("t1/corpus", remove="t2"), "remove"),
]


@pytest.mark.parametrize(("what", "call", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_naming_its_field(
    no_config: Path, what: str, call: Callable[[Any], Any], field: str
) -> None:
    # a port nothing listens on: had anything been sent, this would be a TransportError
    with cpn.Client(f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(errors.Invalid) as refused:
            result = call(client)
            if hasattr(result, "__next__"):
                next(result)
        assert refused.value.field == field, what
        assert refused.value.status == 0  # refused by the SDK, not the broker


def test_a_closed_client_says_so(no_config: Path) -> None:
    client = cpn.Client(f"http://127.0.0.1:{free_port()}")
    client.close()
    with pytest.raises(errors.CpnError, match="closed"):
        client.jobs.get("j-1")
    client.close()  # twice is fine


def test_job_states_read_names_in_any_case_and_comma_separated() -> None:
    from cpn.sdk.jobs import job_states

    got = job_states("running, Pending", "state")
    assert {s.value for s in got} == {"RUNNING", "PENDING"}
    assert job_states(cpn.JobState.FAILED, "states") == {cpn.JobState.FAILED}
    with pytest.raises(errors.Invalid, match="name at least one") as none:
        job_states([], "states")
    assert none.value.field == "states"
    assert json.dumps(sorted(got)) == '["PENDING", "RUNNING"]'


# -- the CLI's job commands over the SDK: exit codes as before ------------------------------


def test_the_job_commands_exit_as_they_did(
    no_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cpn import cli

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    # refused before sending: exit 2, one line naming the option's field
    assert cli.main(["jobs", "--state", "sleeping", "--broker", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cpn: error: unknown job state")
    assert err.rstrip().endswith("(field: state)")
    # an unreachable broker: 1, as every command
    assert cli.main(["describe", "j-1", "--broker", url]) == 1
    assert f"broker at {url} is unreachable" in capsys.readouterr().err
    # no broker anywhere: 1, as before the SDK; a URL that is not one: 2
    assert cli.main(["logs", "j-1"]) == 1
    assert capsys.readouterr().err.startswith("cpn: error: no broker: pass --broker URL")
    assert cli.main(["cancel", "j-1", "--broker", "127.0.0.1:8080"]) == 2
    assert "expected http:// or https://" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.Invalid(0, "bad", "limit"), 2),
        (errors.NotFound(404, "no job"), 2),
        (errors.Conflict(409, "finished"), 2),
        (errors.ServerError(503, "registry down"), 1),
        (errors.TransportError("unreachable"), 1),
        (errors.ConfigError("config.yaml: readable by others"), 2),
        (NoBroker("no broker"), 1),
        (errors.WaitTimeout("late"), 1),
    ],
)
def test_each_sdk_error_has_the_clis_exit_code(exc: errors.CpnError, code: int) -> None:
    from cpn import cli

    assert cli.sdk_exit_code(exc) == code


def test_a_client_never_closed_is_closed_when_collected(no_config: Path) -> None:
    def portals() -> int:
        return sum(t.name == "cpn-sdk" for t in threading.enumerate())

    before = portals()

    def use() -> None:
        client = cpn.Client(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(errors.TransportError):
            client.jobs.get("j-1")  # its session opened: unclosed, aiohttp would warn
        assert portals() == before + 1

    use()
    gc.collect()
    assert portals() == before
