"""Data that follows the work, end to end: real etcd, agent processes with their data stores, a
broker process, HTTP on loopback (docs/data.md).

- a dataset kept at a site the job may not run at is staged to where it runs and read there
  byte for byte; a second job finds it held (no second transfer); the egress is billed;
- the job's outputs become a new version of the tenant's dataset;
- a suspended job resumes from what it saved in its stop grace, and a job whose site is killed
  mid-run resumes at another site from its last checkpoint (the job's own log says which step);
- staging resumes after its source agent is killed and restarted, and skips a corrupt replica;
- the broker's backups are copied to sites' data stores and fetched back once its host is lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cpn import cli
from sites.kits.sealed import new_key
from sites.registry.backups import BackupStore
from sites.registry.client import Registry
from tests.broker.conftest import Federation
from tests.conftest import ADMIN_TOKEN, run_cpn

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

# two east sites (sovereignty keeps the jobs there) and one abroad holding the data
SITES: dict[str, dict[str, Any]] = {
    "east-a": {"region": "east", "coordinates": {"lat": 31.2, "lon": 121.4}, "price": 3.0},
    "east-b": {"region": "east", "coordinates": {"lat": 31.3, "lon": 120.6}, "price": 2.0},
    "abroad": {
        "region": "eu",
        "country": "DE",
        "coordinates": {"lat": 50.1, "lon": 8.7},
        "price": 1.0,
        "count": 8,
    },
}


def _dataset(root: Path) -> dict[str, str]:
    """A small tree with a nested file and a 3 MB one; path -> sha256."""
    (root / "shards").mkdir(parents=True)
    files = {
        "README": b"corpus for the e2e test\n",
        "shards/a.bin": bytes(range(256)) * 4096,
        "shards/b.bin": hashlib.sha256(b"seed").digest() * 100_000,
    }
    out = {}
    for rel, body in files.items():
        (root / rel).write_bytes(body)
        out[rel] = hashlib.sha256(body).hexdigest()
    return out


def _log(fed: Federation, job: str) -> str:
    """The job's current run's log; "" while it has none yet (409 no_logs)."""
    try:
        return fed.get(f"/v1/jobs/{job}/logs")[1]
    except urllib.error.HTTPError as exc:
        if exc.code == 409:
            return ""
        raise


def _agent_metrics(fed: Federation, site: str) -> str:
    """The site agent's /metrics (its URL from its agent record in etcd)."""

    async def url() -> str:
        async with Registry.from_urls(fed.registry.url) as registry:
            agent = (await registry.snapshot()).view(site).agent
            assert agent is not None
            return agent.url

    with urllib.request.urlopen(asyncio.run(url()) + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _events(record: dict[str, Any]) -> list[str]:
    return [f"{e['type']}: {e['message']}" for e in record["events"]]


def test_inputs_follow_the_job_and_outputs_become_a_version(
    make_federation: Callable[..., Federation], tmp_path: Path
) -> None:
    fed = make_federation(SITES)
    # bad inputs name their field; a dataset the tenant cannot read is a 404 as one not there
    status, body = fed.request(
        "POST",
        "/v1/jobs",
        {
            "name": "nothing",
            "tenant": "t1",
            "command": ["true"],
            "inputs": [{"dataset": "nope@1", "path": "/data/x"}],
        },  # fmt: skip
    )
    assert status == 404 and body["error"]["field"] == "inputs[0].dataset", body
    status, body = fed.request(
        "POST",
        "/v1/jobs",
        {
            "name": "bad",
            "tenant": "t1",
            "command": ["true"],
            "inputs": [{"dataset": "x@1", "path": "/etc/passwd"}],
        },  # fmt: skip
    )
    assert status == 400 and body["error"]["field"] == "inputs[0].path", body
    for bad, field in (
        ({"inputs": [{"dataset": "x@1", "path": "../up"}]}, "inputs[0].path"),
        ({"outputs": [{"path": "out", "dataset": "Bad Name"}]}, "outputs[0].dataset"),
        ({"outputs": [{"path": "/abs", "dataset": "ok"}]}, "outputs[0].path"),
        ({"checkpoint_path": "../ckpt"}, "checkpoint_path"),
        ({"checkpoint_store": {"site": "a", "region": "b"}}, "checkpoint_store"),
    ):
        status, body = fed.request(
            "POST", "/v1/jobs", {"name": "bad", "tenant": "t1", "command": ["true"], **bad}
        )
        assert (status, body["error"]["code"], body["error"]["field"]) == (400, "invalid", field)

    want = _dataset(tmp_path / "corpus")
    want_sizes = [p.stat().st_size for p in (tmp_path / "corpus").rglob("*") if p.is_file()]
    put = run_cpn(
        "data", "put", "t1/corpus", str(tmp_path / "corpus"), "--site", "abroad",
        "--broker", fed.broker_url,
    )  # fmt: skip
    assert put.returncode == 0, put.stderr

    # sovereignty: the job may run in the east only, so the data comes to it
    check = (
        "(cd /data/corpus && sha256sum README shards/a.bin shards/b.bin) && mkdir -p out && "
        "cat /data/corpus/shards/*.bin | sha256sum > out/joined.sha && "
        "if touch /data/corpus/x 2>/dev/null; then echo WRITABLE; fi"
    )
    first = fed.submit(
        name="reader",
        cpu=1,
        mem_gb=1,
        allowed_regions=["east"],
        inputs=[{"dataset": "corpus", "path": "/data/corpus"}],
        outputs=[{"path": "out", "dataset": "joined"}],
        command=["sh", "-c", check],
    )
    assert first["spec"]["inputs"][0]["dataset"] == "t1/corpus@1"  # pinned at submit
    done = fed.wait_state(first["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert done["state"] == "SUCCEEDED", _events(done)
    site = done["placement"]["site"]
    assert site.startswith("east-")
    assert "inputs staged from abroad" in done["placement"]["reason"], done["placement"]
    staged = [e for e in _events(done) if "staging" in e and "from abroad" in e]
    assert staged, _events(done)
    text = _log(fed, first["id"])
    for rel, digest in want.items():
        assert f"{digest}  {rel}" in text, text  # the same bytes, read-only at /data/corpus
    assert "WRITABLE" not in text

    # the site's agent counts what it staged and what its store holds
    metrics = _agent_metrics(fed, site)
    pulled = f'cpn_agent_data_pulled_bytes_total{{site="{site}",source="abroad"}}'
    assert pulled in metrics and f'cpn_agent_stagings_total{{result="pulled",site="{site}"}}' \
        in metrics, metrics  # fmt: skip
    assert f'cpn_agent_data_store_objects{{site="{site}"}}' in metrics

    # the output is a new dataset version of the tenant's, registered by the leader's outbox
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, described = fed.request("GET", "/v1/datasets/t1/joined")
        if status == 200 and described.get("versions"):
            break
        time.sleep(0.2)
    assert status == 200, described
    version = described["versions"][0]
    assert version["made_by"] == f"job {first['id']}" and version["files"] == 1

    # the egress of the staging is billed to the tenant
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, usage = fed.request("GET", "/v1/usage?by=tenant")
        if status == 200 and any(row.get("egress_gb", 0) > 0 for row in usage["items"]):
            break
        time.sleep(0.2)
    assert status == 200, usage
    row = next(r for r in usage["items"] if r.get("egress_gb", 0) > 0)
    assert row["egress_gb"] == pytest.approx(sum(want_sizes) / 1e9, rel=0.01), usage
    assert row["egress_usd"] > 0, usage

    # a second reader finds the data held in the east: placed there, nothing staged
    second = fed.submit(
        name="again",
        cpu=1,
        mem_gb=1,
        allowed_regions=["east"],
        inputs=[{"dataset": "t1/corpus@1", "path": "in"}],
        # from the tenant's side: the site's data store (every tenant's blobs, the data key)
        # is not there in its sandbox, only the input it was given
        command=[
            "sh",
            "-c",
            "sha256sum in/README; for s in "
            + " ".join(str(fed.config_dir / f"state/sites/{s}/data-store") for s in SITES)
            + '; do cat "$s/.data-key" && echo LEAKED; ls "$s/blobs" && echo LEAKED; done; true',
        ],
    )
    again = fed.wait_state(second["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert again["state"] == "SUCCEEDED", _events(again)
    assert "inputs held here" in again["placement"]["reason"], again["placement"]
    assert not any(e.startswith("staging") for e in _events(again))
    text = _log(fed, second["id"])
    assert f"{want['README']}  in/README" in text and "LEAKED" not in text, text


# the job: resumes from its checkpoint's step when told to, writes a step file each tick
TRAIN = r"""
ck="$CPN_CHECKPOINT_PATH"; step=0
if [ "$CPN_RESUME" = 1 ] && [ -f "$ck/step" ]; then step=$(cat "$ck/step"); fi
echo "start at step $step on $CPN_SITE"
while [ "$step" -lt 16 ]; do
  step=$((step + 1)); echo "$step" > "$ck/step.tmp" && mv "$ck/step.tmp" "$ck/step"
  head -c 65536 /dev/zero > "$ck/weights.bin"
  sleep 0.2
done
echo "finished at step $step"
"""


def test_checkpoints_follow_a_suspended_job_and_a_moved_one(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(SITES)
    # no periodic sync within the test (interval 1 h): the checkpoint the resumed run starts
    # from is the one the agent synced after the stopped run exited, in its grace
    record = fed.submit(
        name="pausable",
        cpu=1,
        mem_gb=1,
        allowed_regions=["east"],
        checkpoint_interval_s=3600,
        command=["sh", "-c", TRAIN.replace('mv "$ck/step.tmp" "$ck/step"',
                                           'mv "$ck/step.tmp" "$ck/step"; echo "at $step"')],
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "at 6" in _log(fed, record["id"]):
            break
        time.sleep(0.2)
    status, _ = fed.request("POST", f"/v1/jobs/{record['id']}/suspend")
    assert status == 200
    fed.wait_state(record["id"], "SUSPENDED", timeout=30)
    time.sleep(1.0)  # the stopped run's last sync
    status, _ = fed.request("POST", f"/v1/jobs/{record['id']}/resume")
    assert status == 200
    done = fed.wait_state(record["id"], "SUCCEEDED", "FAILED", timeout=90)
    assert done["state"] == "SUCCEEDED", _events(done)
    text = _log(fed, record["id"])
    started = [line for line in text.splitlines() if line.startswith("start at step")]
    assert started and int(started[-1].split()[3]) >= 6, text

    # synced every second: the site is killed with the job, which resumes at another site
    record = fed.submit(
        name="train",
        cpu=1,
        mem_gb=1,
        allowed_regions=["east"],
        checkpoint_interval_s=1,
        max_retries=3,
        command=["sh", "-c", TRAIN],
    )
    deadline = time.monotonic() + 60
    mark: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        now = fed.job(record["id"])
        mark = now.get("checkpoint")
        if now["state"] == "RUNNING" and mark and (mark.get("step") or 0) >= 4:
            break
        time.sleep(0.2)
    assert mark is not None and mark["step"] >= 4, now
    first_site = now["placement"]["site"]
    store = now["checkpoint_site"]
    assert store and store != first_site
    fed.kill(fed.agents[first_site])  # the site dies with the job's process

    done = fed.wait_state(record["id"], "SUCCEEDED", "FAILED", timeout=90)
    assert done["state"] == "SUCCEEDED", _events(done)
    assert done["placement"]["site"] != first_site
    resumed = [e for e in _events(done) if "resumed from checkpoint" in e]
    assert resumed, _events(done)
    text = _log(fed, record["id"])
    started = [line for line in text.splitlines() if line.startswith("start at step")]
    assert started and int(started[-1].split()[3]) >= 4, text  # not from step 0
    assert "finished at step 16" in text


# a slow path from abroad to the east (a link limit at the pulling sites), a replica site west;
# no bulk probes (loopback figures would order the replicas at random): every path is its
# distance class's, so west (same country) is tried before abroad
LIMITED = {"link_limits_mbps": {"abroad": 24}}
SLOW: dict[str, dict[str, Any]] = {
    "east-a": {**SITES["east-a"], "data": LIMITED, "bandwidth_interval_s": 0},
    "west": {"region": "west", "coordinates": {"lat": 37.5, "lon": 105.2}, "price": 5.0,
             "bandwidth_interval_s": 0},
    "abroad": {**SITES["abroad"], "bandwidth_interval_s": 0},
}  # fmt: skip


UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def _wait_replica(fed: Federation, name: str, site: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, body = fed.request("GET", f"/v1/datasets/t1/{name}")
        if status == 200 and site in body["versions"][0]["replicas"]:
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} never held at {site}")


def test_staging_resumes_after_the_source_restarts_and_skips_a_corrupt_replica(
    make_federation: Callable[..., Federation], tmp_path: Path
) -> None:
    fed = make_federation(SLOW)
    big = tmp_path / "big"
    big.mkdir()
    body = hashlib.sha256(b"big").digest() * 375_000  # 12 MB: ~4 s at 24 Mbit/s
    (big / "weights.bin").write_bytes(body)
    put = run_cpn("data", "put", "t1/big", str(big), "--site", "abroad", "--broker", fed.broker_url)
    assert put.returncode == 0, put.stderr

    job = fed.submit(
        name="slow", cpu=1, mem_gb=1, allowed_regions=["east"],
        inputs=[{"dataset": "big", "path": "in"}], command=["sha256sum", "in/weights.bin"],
    )  # fmt: skip
    deadline = time.monotonic() + 30
    seen = 0
    while time.monotonic() < deadline:
        staging = fed.job(job["id"]).get("staging") or {}
        seen = staging.get("bytes_done", 0)
        if seen > 2_000_000:
            break
        time.sleep(0.1)
    assert 2_000_000 < seen < len(body), seen  # caught mid-transfer
    fed.kill(fed.agents["abroad"])  # the source dies mid-transfer ...
    time.sleep(1.0)
    fed.start_agent("abroad")  # ... and comes back with the same data key
    done = fed.wait_state(job["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert done["state"] == "SUCCEEDED", _events(done)
    assert f"{hashlib.sha256(body).hexdigest()}  in/weights.bin" in _log(fed, job["id"])
    # the same run: its agent found the restarted source at its new address and went on
    assert not any("staging failed" in e for e in _events(done)), _events(done)
    moved = [e for e in _events(done) if e.startswith("succeeded") and "staging " in e]
    assert moved, _events(done)
    # resumed, not started over: what crossed the wire is the file about once ("12 MB")
    amount, unit = moved[-1].split("staging ")[1].split()[:2]
    assert float(amount) * UNITS[unit] < len(body) * 1.2, moved

    # a replica west with one corrupt byte: staging tries it first (the faster path), detects
    # the bad sha256 and takes the file from abroad
    small = tmp_path / "small"
    small.mkdir()
    data = bytes(range(256)) * 2048
    (small / "part.bin").write_bytes(data)
    assert run_cpn("data", "put", "t1/small", str(small), "--site", "abroad",
                   "--broker", fed.broker_url).returncode == 0  # fmt: skip
    replicate = run_cpn("data", "replicate", "t1/small", "--to", "west", "--broker", fed.broker_url)
    assert replicate.returncode == 0, replicate.stderr
    _wait_replica(fed, "small", "west")
    blob = fed.config_dir / "state/sites/west/data-store/blobs" / hashlib.sha256(data).hexdigest()
    blob.chmod(0o644)
    with blob.open("r+b") as f:
        f.seek(1000)
        f.write(b"\xff")
    reader = fed.submit(
        name="careful", cpu=1, mem_gb=1, allowed_regions=["east"],
        inputs=[{"dataset": "small", "path": "in"}], command=["sha256sum", "in/part.bin"],
    )  # fmt: skip
    done = fed.wait_state(reader["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert done["state"] == "SUCCEEDED", _events(done)
    assert f"{hashlib.sha256(data).hexdigest()}  in/part.bin" in _log(fed, reader["id"])
    # the run pulled from both: west's corrupt file was refused and fetched again from abroad
    staged = [e for e in _events(done) if "staging" in e and " from " in e]
    assert staged and "abroad" in staged[-1] and "west" in staged[-1], _events(done)


def test_backups_leave_the_broker_host_and_come_back_from_a_site(
    make_federation: Callable[..., Federation],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/backup.md, "Copies at the sites": the leader's backups are put at two sites' data
    stores, sealed with the backup key (checked by sha256), pruned there with the local ones;
    with the broker's host lost (its process killed, its backups deleted) `cpn backup fetch`
    brings the newest back from a site with an admin token and the key, and `cpn backup verify`
    passes on it; a tenant's token is refused."""
    key = tmp_path / "backup.key"  # kept off the broker's host
    new_key(key)
    backup = {
        "interval_s": 1.0, "keep": 2, "copies": 2, "home_region": "east", "key_file": str(key),
    }  # fmt: skip
    fed = make_federation(SITES, settings={"backup": backup})
    assert fed.broker is not None
    args = [str(a) for a in fed.broker.args]  # type: ignore[union-attr]
    local = Path(args[args.index("--state-dir") + 1]) / "backups"
    stores = {site: fed.config_dir / f"state/sites/{site}/data-store/backups" for site in SITES}

    def cpn(*argv: str) -> tuple[int, str, str]:  # in-process: no interpreter to start
        code = cli.main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # three taken (one pruned), the newest copied twice
        taken = BackupStore(local).backups()
        seen |= {b.name for b in taken}
        if len(seen) >= 3 and len(taken) == 2 and len(taken[-1].copies) == 2:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"backups not copied: {BackupStore(local).backups()}")
    first, newest = min(seen), taken[-1]
    code, out, _ = cpn("backup", "ls", "--dir", str(local))
    assert code == 0 and f"local, {', '.join(newest.copies)}" in out, out
    # abroad first: not the broker's home region (east)
    assert newest.copies[0] == "abroad" and newest.copies[1] in ("east-a", "east-b")
    for site in newest.copies:  # sealed with the key: checked there as the sealed file
        held = (stores[site] / f"{newest.name}.db").read_bytes()
        there = json.loads((stores[site] / f"{newest.name}.json").read_text())
        assert there["sealed"] and there["plain_sha256"] == newest.sha256
        assert hashlib.sha256(held).hexdigest() == there["sha256"] != newest.sha256
    # retention: no site keeps the pruned first one, none more than keep
    for site, where in stores.items():
        names = sorted(p.stem for p in where.glob("cpn-*.json")) if where.exists() else []
        assert first not in names and len(names) <= 2, (site, names)
    code, out, err = cpn("backup", "ls", "--sites", "--etcd", fed.registry.url, "-o", "json")
    assert code == 0, err
    assert {(r["site"], r["name"]) for r in json.loads(out)} >= {
        (s, newest.name) for s in newest.copies
    }

    tenant = _tenant_token(fed)
    # the broker's host is lost: its process and its backups
    fed.kill(fed.broker)
    shutil.rmtree(local)
    url = _agent_url(fed, "abroad")
    new_host = tmp_path / "new-host"
    monkeypatch.setenv("CPN_TOKEN", tenant)
    code, _, err = cpn("backup", "fetch", "--from", url, "--dir", str(new_host))
    assert code == 2 and err.count("\n") == 1 and "only an admin token" in err, err
    monkeypatch.setenv("CPN_TOKEN", ADMIN_TOKEN)
    code, _, err = cpn("backup", "fetch", "--from", url, "--dir", str(new_host))
    assert code == 2 and "is sealed: give the backup key" in err, err
    code, out, err = cpn(
        "backup", "fetch", "--from", url, "--dir", str(new_host), "--key", str(key)
    )
    assert code == 0, err
    name = sorted(p.stem for p in stores["abroad"].glob("cpn-*.json"))[-1]
    assert f"fetched {name}" in out and "sha256 checked" in out
    verified = run_cpn("backup", "verify", name, "--dir", str(new_host), timeout=120)
    assert verified.returncode == 0, verified.stderr
    assert "ok: size and sha256 match its description" in verified.stdout


def _agent_url(fed: Federation, site: str) -> str:
    async def url() -> str:
        async with Registry.from_urls(fed.registry.url) as registry:
            agent = (await registry.snapshot()).view(site).agent
            assert agent is not None
            return agent.url

    return asyncio.run(url())


def _tenant_token(fed: Federation) -> str:
    status, made = fed.request("POST", "/v1/tokens", {"role": "tenant-admin", "tenant": "t1"})
    assert status == 201, made
    return str(made["token"])
