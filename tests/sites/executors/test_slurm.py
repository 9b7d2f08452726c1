"""The Slurm executor and perception against a real single-machine Slurm (tests/sites/conftest.py):
real slurmctld, slurmd, slurmdbd and MariaDB, real etcd, real agent and broker processes.

The node's GPUs are placeholders (GRES on empty files, sites/emulation/slurm_cluster.py): the fake
is the
GPU, never Slurm. The tenants' Unix users are real users of this host (the node), made for the
module and removed after it (``tenant_users``).
"""

from __future__ import annotations

import contextlib
import json
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from sites.agent.collectors.slurm import capacity, parse_nodes
from sites.emulation.slurm_cluster import LocalSlurm
from sites.executors.accounts import Account
from sites.executors.base import ExecutorError, RunExit
from sites.executors.slurm_batch import batch_script, run_as, sbatch_args, time_limit_min
from sites.executors.slurm_jobs import SlurmJob, job_usage, slurm_exit
from sites.model import keys
from sites.model.assignments import Assignment, RunState
from sites.model.spec import SlurmSettings
from sites.registry.client import Registry
from tests.broker.conftest import BROKER_SETTINGS, Federation, federation_site, join_sites
from tests.conftest import CONFIGS, Processes, run_cpn
from tests.sites.agent.test_agent import join
from tests.sites.executors.test_executor import assign, assignment, get_report, wait_report

# setup may install the packages (.ci/install-slurm) and starts five daemons
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SITE = "hpc"
# tenant -> (its Unix user at the site, uid): real users of this host, made by `tenant_users`
# in a high range no other test hands out (uid_range defaults to 400000-499999)
TENANT_USERS = {"acme": ("cpnsl-acme", 620101), "beta": ("cpnsl-beta", 620102)}
# each user's Slurm accounts: acme's user may not charge "other" (a site-file check refuses it)
USER_ACCOUNTS = {"acme": ("acme",), "beta": ("other",)}


def slurm_site(cluster: LocalSlurm, work: Path, **executor: Any) -> dict[str, Any]:
    doc = federation_site(SITE, {"region": "east", "coordinates": {"lat": 31.2, "lon": 121.4},
                                 "price": 1.0})  # fmt: skip
    doc["executor"] = {
        "kind": "slurm",
        "partition": cluster.partition,
        "work_dir": str(work),
        "slurm": {
            "accounts": {"acme": {"account": "acme", "qos": "normal"}},
            "default_account": {"account": "other"},
            "poll_s": 0.2,
            "conf": str(cluster.conf),
        },
        "confinement": {
            "accounts": {"tenants": {tenant: user for tenant, (user, _) in TENANT_USERS.items()}}
        },
    }
    for key, value in executor.items():
        if key == "slurm":
            doc["executor"]["slurm"].update(value)
        else:
            doc["executor"][key] = value
    return doc


def sacct(slurm: LocalSlurm, *args: str) -> list[dict[str, str]]:
    fields = "JobID,JobName,State,ExitCode,Account,QOS,AllocTRES,Timelimit,Comment"
    out = slurm.run("sacct", "-n", "-P", "-X", "-o", fields, *args).stdout
    names = fields.split(",")
    return [dict(zip(names, line.split("|"), strict=True)) for line in out.splitlines()]


def sacct_of(slurm: LocalSlurm, job: str) -> list[dict[str, str]]:
    return [row for row in sacct(slurm) if row["JobName"] == f"cpn-{job}"]


@contextlib.contextmanager
def unix_users(
    slurm: LocalSlurm, users: Mapping[str, tuple[str, int]], accounts: Mapping[str, Sequence[str]]
) -> Iterator[dict[str, str]]:
    """Unix users of this host (the cluster's node) for the tenants, each associated with its
    Slurm accounts; their jobs cancelled, associations and users removed on exit."""
    made = []
    try:
        for tenant, (name, uid) in users.items():
            with contextlib.suppress(KeyError):
                pwd.getpwnam(name)  # left by an interrupted run: ours by its name
                subprocess.run(["userdel", name], check=True, capture_output=True)
            subprocess.run(
                ["useradd", "--no-create-home", "--user-group", "--uid", str(uid),
                 "--shell", "/usr/sbin/nologin", name],
                check=True, capture_output=True,
            )  # fmt: skip
            made.append(name)
            slurm.associate(name, accounts[tenant])
        yield {tenant: name for tenant, (name, _) in users.items()}
    finally:
        for name in made:
            slurm.run("scancel", "--user", name, check=False)
        wait_until(lambda: not slurm.run("squeue", "-h", "-u", ",".join(made), check=False)
                   .stdout.strip(), timeout=30)  # fmt: skip
        for name in made:
            slurm.dissociate(name)
            subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture(scope="module")
def tenant_users(slurm: LocalSlurm) -> Iterator[dict[str, str]]:
    """tenant -> its Unix user, for the module (TENANT_USERS)."""
    with unix_users(slurm, TENANT_USERS, USER_ACCOUNTS) as users:
        yield users


@pytest.fixture
def slurm_tenants(
    local_slurm: LocalSlurm, tenant_users: dict[str, str]
) -> Iterator[dict[str, str]]:
    """The tenants' users, their jobs cancelled after each test (local_slurm cancels root's)."""
    yield tenant_users
    for name in tenant_users.values():
        local_slurm.run("scancel", "--user", name, check=False)


@pytest.fixture
def site_work() -> Iterator[Path]:
    """The Slurm site's work dir, where the tenants' users can reach it: a test's tmp_path is
    0700 (pytest's), a site's work dir must be passable (docs/slurm.md)."""
    path = Path(tempfile.mkdtemp(prefix="cpn-slurm-site-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def slurm_federation(
    local_slurm: LocalSlurm,
    registry: Registry,
    processes: Processes,
    tmp_path: Path,
    slurm_tenants: dict[str, str],
    site_work: Path,
) -> Callable[..., Federation]:
    def make(**executor: Any) -> Federation:
        cfg = tmp_path / "configs"
        (cfg / "sites").mkdir(parents=True)
        shutil.copy(CONFIGS / "devices.yaml", cfg / "devices.yaml")
        shutil.copytree(CONFIGS / "latency", cfg / "latency")
        regions = {"user_regions": [{"id": "user-east", "lat": 31.23, "lon": 121.47}]}
        (cfg / "regions.yaml").write_text(yaml.safe_dump(regions))
        (cfg / "tenants.yaml").write_text(yaml.safe_dump({"tenants": {}}))
        settings = {**BROKER_SETTINGS, "scheduling": {**BROKER_SETTINGS["scheduling"]}}
        (cfg / "broker.yaml").write_text(yaml.safe_dump(settings))
        doc = slurm_site(local_slurm, site_work, **executor)
        (cfg / "sites" / f"{SITE}.yaml").write_text(yaml.safe_dump(doc))
        join_sites(registry.url, [cfg / "sites" / f"{SITE}.yaml"], cfg / "devices.yaml")
        fed = Federation(registry=registry, processes=processes, config_dir=cfg)
        fed.start_agent(SITE)
        fed.start_broker()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            items = json.loads(fed.get("/v1/sites")[1])["items"]
            if items and items[0]["state"] == "up":
                return fed
            time.sleep(0.1)
        raise AssertionError(f"slurm site not up: {items}")

    return make


def free_of(fed: Federation) -> dict[str, Any]:
    items = json.loads(fed.get("/v1/sites")[1])["items"]
    free: dict[str, Any] = items[0]["free"]
    return free


# -- end to end: broker, agent, Slurm ------------------------------------------------------------


def test_placed_job_runs_under_slurm_and_its_output_comes_back(
    slurm_federation: Callable[..., Federation], local_slurm: LocalSlurm
) -> None:
    fed = slurm_federation()
    record = fed.submit(
        name="train",
        tenant="acme",
        gpu={"model": "H100", "count": 2},
        cpu=2,
        mem_gb=1.5,
        duration_hours=0.25,
        checkpoint_path="/ckpt/train",
        command=["sh", "-c", "echo job=$CPN_JOB_ID site=$CPN_SITE ckpt=$CPN_CHECKPOINT_PATH; "
                             "echo slurm=$SLURM_JOB_ID account=$SLURM_JOB_ACCOUNT"],
    )  # fmt: skip
    done = fed.wait_state(record["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert done["state"] == "SUCCEEDED", done["events"]
    rows = wait_rows(local_slurm, record["id"])
    assert len(rows) == 1, rows  # sacct shows it, once
    row = rows[0]
    assert (row["State"], row["ExitCode"], row["Account"], row["QOS"]) == (
        "COMPLETED", "0:0", "acme", "normal",
    )  # fmt: skip
    assert "gres/gpu:h100=2" in row["AllocTRES"] and "cpu=2" in row["AllocTRES"]
    assert "mem=1.50G" in row["AllocTRES"]
    assert row["Timelimit"] == "00:23:00"  # 0.25 h x 1.5 margin, rounded up to minutes
    assert row["Comment"] == f"cpn:{SITE}:{record['id']}:1:{done['fence']}"
    logs = run_cpn("logs", record["id"], "--broker", fed.broker_url)
    assert logs.returncode == 0, logs.stderr
    assert f"job={record['id']} site={SITE} ckpt=/ckpt/train" in logs.stdout
    assert f"slurm={row['JobID']} account=acme" in logs.stdout
    # the usage ledger's segment of the run carries Slurm's own accounting (sacct)
    import asyncio

    from sites.model import keys

    async def segments() -> list[dict[str, Any]]:
        async with Registry.from_urls(fed.registry.url) as registry:  # this test's own loop
            _, kvs = await registry.list_prefix(keys.USAGE_SEGMENTS)
        return [json.loads(raw) for _, raw, _ in kvs]

    (segment,) = [s for s in asyncio.run(segments()) if s["job"] == record["id"]]
    assert segment["site"] == SITE and segment["measured"] is not None, segment
    assert segment["measured"]["gpu_s:H100"] == 2 * segment["measured"]["elapsed_s"]
    # a tenant with no mapping runs under the default account
    other = fed.submit(name="other", tenant="beta", cpu=1, mem_gb=0.5, command=["true"])
    assert fed.wait_state(other["id"], "SUCCEEDED", "FAILED", timeout=60)["state"] == "SUCCEEDED"
    assert wait_rows(local_slurm, other["id"])[0]["Account"] == "other"


def test_cancel_suspend_and_an_outside_scancel_reach_slurm(
    slurm_federation: Callable[..., Federation], local_slurm: LocalSlurm
) -> None:
    fed = slurm_federation()
    spec = {"tenant": "acme", "cpu": 1, "mem_gb": 0.5, "command": ["sleep", "60"]}
    suspended = fed.submit(name="pause-me", **spec)
    cancelled = fed.submit(name="stop-me", **spec)
    killed = fed.submit(name="kill-me", max_retries=0, **spec)
    for job in (suspended, cancelled, killed):
        fed.wait_state(job["id"], "RUNNING", timeout=30)
        wait_for_state(local_slurm, job["id"], "RUNNING")
    # suspend: scancel (Slurm's SIGTERM, time to checkpoint, then SIGKILL); resume runs anew
    assert fed.request("POST", f"/v1/jobs/{suspended['id']}/suspend")[1]["state"] == "SUSPENDED"
    assert fed.request("POST", f"/v1/jobs/{cancelled['id']}/cancel")[1]["state"] == "CANCELLED"
    for job in (suspended, cancelled):
        assert wait_for_state(local_slurm, job["id"], "CANCELLED")["State"] == "CANCELLED by 0"
    # resume: a new attempt, a new Slurm job
    assert fed.request("POST", f"/v1/jobs/{suspended['id']}/resume")[1]["state"] == "PENDING"
    resumed = fed.wait_state(suspended["id"], "RUNNING", timeout=30)
    assert resumed["attempt"] == 2
    rows = wait_rows(local_slurm, suspended["id"], count=2)
    assert len(rows) == 2 and rows[0]["JobID"] != rows[1]["JobID"], rows
    queued = local_slurm.run("squeue", "-h", "-j", rows[1]["JobID"], "-o", "%k").stdout.strip()
    assert queued == f"cpn:{SITE}:{suspended['id']}:2:{resumed['fence']}"
    # killed in Slurm, not by cpn: FAILED, and the reason says so
    slurm_id = wait_for_state(local_slurm, killed["id"], "RUNNING")["JobID"]
    local_slurm.run("scancel", slurm_id)
    failed = fed.wait_state(killed["id"], "FAILED", timeout=30)
    assert f"slurm job {slurm_id}: cancelled in Slurm by uid 0" in failed["events"][-1]["message"]


def test_a_job_queued_in_slurm_stays_placed_with_slurms_reason_until_it_runs(
    slurm_federation: Callable[..., Federation], local_slurm: LocalSlurm
) -> None:
    fed = slurm_federation()
    partition = f"partitionname={local_slurm.partition}"
    local_slurm.run("scontrol", "update", partition, "state=down")  # takes jobs, starts none
    try:
        job = fed.submit(name="queued", tenant="acme", cpu=1, mem_gb=0.5, command=["true"])

        def queued() -> bool:
            record = fed.job(job["id"])
            return record["state"] == "PLACED" and "PartitionDown" in (
                record.get("unschedulable") or ""
            )

        assert wait_until(queued, timeout=40), fed.job(job["id"])
        record = fed.job(job["id"])
        assert record["unschedulable"] == f"queued at {SITE}: pending in Slurm: PartitionDown"
        assert any(e["type"] == "queued" for e in record["events"])
        assert not any(e["type"] == "running" for e in record["events"])
    finally:
        local_slurm.run("scontrol", "update", partition, "state=up")
    done = fed.wait_state(job["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert done["state"] == "SUCCEEDED", done["events"]
    assert done.get("unschedulable") is None
    types = [e["type"] for e in done["events"]]
    assert types.index("queued") < types.index("running") < types.index("succeeded")


def test_broker_sees_slurm_capacity_and_a_drained_node_drops_out(
    slurm_federation: Callable[..., Federation], local_slurm: LocalSlurm
) -> None:
    fed = slurm_federation()
    free = free_of(fed)  # Slurm's node, not the site file's 16 x H100 and 256 cores
    assert free["devices"] == {"H100": 4} and free["cpu_cores"] == 8
    job = fed.submit(name="hold", tenant="acme", gpu={"model": "H100", "count": 1}, cpu=1,
                     mem_gb=0.5, command=["sleep", "30"])  # fmt: skip
    fed.wait_state(job["id"], "RUNNING", timeout=30)
    wait_for_state(local_slurm, job["id"], "RUNNING")
    assert wait_until(lambda: free_of(fed)["devices"] == {"H100": 3})
    local_slurm.run(
        "scontrol", "update", f"nodename={local_slurm.node}", "state=drain", "reason=cpn-test"
    )
    assert wait_until(lambda: free_of(fed)["devices"] == {} and free_of(fed)["cpu_cores"] == 0)
    local_slurm.run("scontrol", "update", f"nodename={local_slurm.node}", "state=resume")
    assert wait_until(lambda: free_of(fed)["devices"] == {"H100": 3})


# -- the agent and Slurm, without a broker -------------------------------------------------------


async def test_restarted_agent_reattaches_and_submits_nothing_twice(
    local_slurm: LocalSlurm,
    registry: Registry,
    processes: Processes,
    tmp_path: Path,
    slurm_tenants: dict[str, str],
    site_work: Path,
) -> None:
    file = tmp_path / f"{SITE}.yaml"
    file.write_text(yaml.safe_dump(slurm_site(local_slurm, site_work)))
    await join(registry, file)
    first = start_slurm_agent(processes, registry, file)
    stay = assignment(SITE, "stay", ["sh", "-c", "sleep 8; echo finished"], tenant="acme")
    gone = assignment(SITE, "gone", ["sleep", "60"], tenant="acme")
    await assign(registry, stay)
    await assign(registry, gone)
    await wait_report(registry, SITE, "stay", RunState.running, timeout=20)
    await wait_report(registry, SITE, "gone", RunState.running, timeout=20)
    wait_for_state(local_slurm, "stay", "RUNNING")
    first.kill()
    first.wait()
    # while no agent runs: one job's assignment is withdrawn, the other's is kept
    await registry.delete_prefix(keys.assignment(SITE, "gone"))
    slurm_id = wait_for_state(local_slurm, "stay", "RUNNING")["JobID"]  # it outlives the agent
    assert local_slurm.run("squeue", "-h", "-j", slurm_id, "-o", "%T").stdout.strip() == "RUNNING"
    # another tenant's job (beta's user) with stay's comment, as a job of beta's could sbatch
    forged = local_slurm.run(
        "sbatch", "--parsable", f"--uid={slurm_tenants['beta']}", "--account=other",
        f"--comment=cpn:{SITE}:stay:1:{stay.fence}", "--job-name=forged", "--chdir=/tmp",
        "--output=/dev/null", "--wrap=sleep 60",
    ).stdout.strip()  # fmt: skip
    second = start_slurm_agent(processes, registry, file)
    report = await wait_report(registry, SITE, "stay", RunState.succeeded, timeout=30)
    assert report.exit_code == 0
    usage = report.usage or {}  # accounting from sacct: the allocation times the elapsed time
    assert usage["elapsed_s"] >= 8 and usage["cpu_core_s"] == usage["elapsed_s"]
    assert usage["mem_gb_s"] > 0 and "energy_j" not in usage  # no energy plugin here
    rows = sacct_of(local_slurm, "stay")
    assert len(rows) == 1 and rows[0]["State"] == "COMPLETED", rows  # submitted once
    log = Path(str(report.log_path)).read_text()
    assert log.count("finished") == 1
    assert wait_for_state(local_slurm, "gone", "CANCELLED")  # withdrawn: cancelled
    gone_report = await get_report(registry, SITE, "gone")
    assert gone_report is not None and gone_report.state is RunState.running  # the broker's call
    agent_log = processes.log(f"agent-{SITE}-{second.pid}")
    assert "adopted run" in agent_log
    # the forged one is not followed as stay's: cancelled, as not the tenant's user's
    assert f"cancelling slurm job {forged} of job stay: it runs as cpnsl-beta" in agent_log
    state = local_slurm.run("sacct", "-n", "-P", "-X", "-j", forged, "-o", "State").stdout
    assert state.strip() == "CANCELLED by 0", state


async def test_site_file_naming_what_slurm_lacks_is_refused_with_the_field(
    local_slurm: LocalSlurm, registry: Registry, tmp_path: Path, slurm_tenants: dict[str, str]
) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"partition": "nope"}, "executor.partition: Slurm has no partition 'nope' (it has: "),
        (
            {"slurm": {"accounts": {"acme": {"account": "ghost"}}}},
            "executor.slurm.accounts.acme.account: Slurm has no account 'ghost'",
        ),
        (
            {"slurm": {"accounts": {"acme": {"account": "acme", "qos": "gold"}}}},
            "executor.slurm.accounts.acme.qos: Slurm has no QOS 'gold'",
        ),
        (  # acme's user may charge acme only
            {"slurm": {"accounts": {"acme": {"account": "other"}}}},
            "executor.confinement.accounts.tenants.acme: Slurm user 'cpnsl-acme' has no "
            "association with account 'other'",
        ),
        (
            {"confinement": {"accounts": {"tenants": {"acme": "cpnsl-ghost"}}}},
            "executor.confinement.accounts.tenants.acme: no account 'cpnsl-ghost' on this host",
        ),
        (
            {"confinement": {"accounts": {"tenants": {"acme": "root"}}}},
            "executor.confinement.accounts.tenants.acme: 'root' is root or the agent's account",
        ),
    ]
    for executor, message in cases:
        file = tmp_path / f"{SITE}.yaml"
        file.write_text(yaml.safe_dump(slurm_site(local_slurm, tmp_path / "work", **executor)))
        await join(registry, file)
        result = run_cpn("agent", "--site", str(file), "--interval", "1", etcd_url=registry.url)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr, result.stderr
    # what pydantic catches already: Slurm settings on a local site, a bad account name
    bad = slurm_site(local_slurm, tmp_path / "work")
    bad["executor"]["kind"] = "local"
    del bad["executor"]["partition"]
    file.write_text(yaml.safe_dump(bad))
    result = run_cpn("site", "validate", str(file))
    assert "executor.slurm" in result.stderr + result.stdout
    assert "applies to the slurm executor only" in result.stderr + result.stdout


# -- pure parts: the mapping both ways ----------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "exit_code", "by", "expected"),
    [
        ("COMPLETED", "0:0", "", RunExit(0)),
        ("FAILED", "3:0", "", RunExit(3)),
        ("FAILED", "0:9", "", RunExit(-9)),
        ("CANCELLED", "0:15", "1000", RunExit(-15, "slurm job 7: cancelled in Slurm by uid 1000")),
        (
            "TIMEOUT",
            "0:0",
            "",
            RunExit(None, "slurm job 7: TIMEOUT: it ran past its Slurm time limit"),
        ),  # fmt: skip
        (
            "NODE_FAIL",
            "0:0",
            "",
            RunExit(None, "slurm job 7: NODE_FAIL: a node of its allocation failed"),
        ),  # fmt: skip
        (
            "PREEMPTED",
            "0:15",
            "",
            RunExit(-15, "slurm job 7: PREEMPTED: Slurm preempted it for another job"),
        ),  # fmt: skip
        (
            "OUT_OF_MEMORY",
            "0:125",
            "",
            RunExit(-125, "slurm job 7: OUT_OF_MEMORY: it used more memory than it asked for"),
        ),  # fmt: skip
    ],
)
def test_slurm_states_map_to_an_exit_and_a_reason(
    state: str, exit_code: str, by: str, expected: RunExit
) -> None:
    ended = slurm_exit(SlurmJob(id="7", state=state, exit_code=exit_code, by=by))
    assert ended == expected
    assert ended.ok is (state == "COMPLETED")


def test_sbatch_options_follow_the_assignment_and_the_site_file(tmp_path: Path) -> None:
    settings = SlurmSettings.model_validate(
        {"accounts": {"acme": {"account": "a1", "qos": "high"}}, "gres_types": {"H100": "hopper"}}
    )
    a = Assignment(
        job="j", site="s", tenant="acme", attempt=2, fence=9, command=("run",), model="H100",
        gpus=4, cpu=16, mem_gb=64, duration_s=3600, assigned_at=0,
    )  # fmt: skip
    user = Account(uid=620900, gid=620950, name="acme-user")
    args = sbatch_args(a, site="s", settings=settings, partition="gpu", log_path=tmp_path / "l",
                       cwd=tmp_path, user=user)  # fmt: skip
    expected = (
        "--job-name=cpn-j", "--comment=cpn:s:j:2:9", "--account=a1", "--qos=high",
        "--partition=gpu", "--gres=gpu:hopper:4", "--cpus-per-task=16", "--mem=65536M",
        "--time=90", "--nodes=1", "--ntasks=1", "--no-requeue",
        "--uid=acme-user", "--gid=620950", "--export=NONE",
    )  # fmt: skip
    for option in expected:
        assert option in args
    assert time_limit_min(a.model_copy(update={"duration_s": 60}), settings) == 10  # the floor
    with pytest.raises(Exception, match="tenant 'beta' has no Slurm account at site s"):
        sbatch_args(a.model_copy(update={"tenant": "beta"}), site="s", settings=settings,
                    partition=None, log_path=tmp_path, cwd=tmp_path, user=user)  # fmt: skip
    # slices: a MIG instance by its <model>_<profile> type, a time slice as a Slurm shard
    mig = a.model_copy(update={"model": "A100-80GB/3g.40gb", "gpus": 1})
    assert "--gres=gpu:a100-80gb_3g.40gb:1" in sbatch_args(
        mig, site="s", settings=settings, partition=None, log_path=tmp_path, cwd=tmp_path,
        user=user,
    )  # fmt: skip
    shared = a.model_copy(update={"model": "H100/ts4", "gpus": 1})
    assert "--gres=shard:1" in sbatch_args(
        shared, site="s", settings=settings, partition=None, log_path=tmp_path, cwd=tmp_path,
        user=user,
    )  # fmt: skip
    script = batch_script(
        a.model_copy(update={"env": {"X": "a b", "PATH": "/opt/x/bin"}}), site="s",
        base={"PATH": "/usr/bin:/bin", "HOME": "/w", "USER": "acme-user"},
    )  # fmt: skip
    assert "export X='a b'" in script and "export CPN_JOB_ID=j" in script
    assert "export HOME=/w" in script and "export USER=acme-user" in script
    assert "export PATH=/opt/x/bin" in script  # the job's own env wins over the allow-list
    assert "export SLURM_EXPORT_ENV=ALL" in script  # its srun steps inherit what it has
    assert script.rstrip().endswith("exec run")


def test_a_tenant_runs_only_as_its_named_user_and_only_a_root_agent_submits_for_it() -> None:
    named = {"acme": Account(uid=620900, gid=620900, name="acme-user")}
    assert run_as("acme", site="s", named=named, root=True) == named["acme"]
    with pytest.raises(ExecutorError) as err:
        run_as("beta", site="s", named=named, root=True)
    assert str(err.value) == (
        "tenant 'beta' has no Unix user at Slurm site s: name one in "
        "executor.confinement.accounts.tenants (a uid_range gives no user that Slurm's nodes know)"
    )
    with pytest.raises(ExecutorError, match="the agent is not root, and only root may submit"):
        run_as("acme", site="s", named=named, root=False)


def test_usage_is_the_allocation_times_the_elapsed_time() -> None:
    line = "12|COMPLETED|100|billing=4,cpu=4,gres/gpu:h100=2,gres/gpu=2,mem=2G,node=1|5400\n"
    usage = job_usage(line, "12", models={"h100": "H100"})
    assert usage == {
        "elapsed_s": 100.0, "cpu_core_s": 400.0, "gpu_s:H100": 200.0, "mem_gb_s": 200.0,
        "energy_j": 5400.0,
    }  # fmt: skip
    assert job_usage("12|RUNNING|100|cpu=4|0\n", "12", models={}) is None


def test_nodes_out_of_service_count_for_nothing() -> None:
    text = (
        "NodeName=n1 CPUAlloc=2 CPUTot=8 RealMemory=16000 AllocMem=1024 State=MIXED "
        "Partitions=debug CfgTRES=cpu=8,mem=16000M,gres/gpu=4,gres/gpu:h100=4 "
        "AllocTRES=cpu=2,mem=1G,gres/gpu=1,gres/gpu:h100=1\n"
        "NodeName=n2 CPUAlloc=0 CPUTot=8 RealMemory=16000 AllocMem=0 State=IDLE+DRAIN "
        "Partitions=debug CfgTRES=cpu=8,gres/gpu:h100=4 AllocTRES= Reason=disk bad [root@t]\n"
    )
    cap = capacity(parse_nodes(text), models={"h100": "H100"})
    assert cap.devices == {"H100": 4} and cap.devices_free == {"H100": 3}
    assert (cap.cpu_cores, cap.cpu_free, cap.nodes) == (8, 6, 1)
    assert cap.nodes_out == ("n2: DRAIN+IDLE (disk bad)",)
    assert capacity(parse_nodes(text), models={"h100": "H100"}, partition="other").nodes == 0


# -- helpers -------------------------------------------------------------------------------------


def start_slurm_agent(
    processes: Processes, registry: Registry, file: Path
) -> subprocess.Popen[bytes]:
    proc = processes.start("agent", "--site", str(file), "--etcd", registry.url, "--interval", "1",
                           "--probe-method", "http", name=f"agent-{SITE}-pending")  # fmt: skip
    # the log is named before the pid is known; give it the pid's name for the asserts
    src = processes.log_dir / f"agent-{SITE}-pending.log"
    dst = processes.log_dir / f"agent-{SITE}-{proc.pid}.log"
    src.rename(dst)
    return proc


def wait_until(predicate: Callable[[], bool], timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def wait_rows(slurm: LocalSlurm, job: str, count: int = 1) -> list[dict[str, str]]:
    """sacct's rows of the job once it has ``count`` finished or running ones."""
    rows: list[dict[str, str]] = []

    def enough() -> bool:
        nonlocal rows
        rows = sacct_of(slurm, job)
        return len(rows) >= count and all(r["State"] != "PENDING" for r in rows)

    wait_until(enough, timeout=20)
    return rows


def wait_for_state(slurm: LocalSlurm, job: str, *states: str) -> dict[str, str]:
    """The job's latest sacct row once its state starts with one of ``states``."""
    found: dict[str, str] = {}

    def reached() -> bool:
        nonlocal found
        rows = sacct_of(slurm, job)
        found = rows[-1] if rows else {}
        return bool(found) and found["State"].startswith(states)

    if not wait_until(reached, timeout=30):
        raise AssertionError(f"slurm job of {job} is {found.get('State')}, not {states}")
    return found


def test_bad_gres_types_name_their_field(tmp_path: Path) -> None:
    from sites.model.catalog import DeviceCatalog
    from sites.model.config import parse_site
    from sites.model.errors import ConfigError
    from tests.conftest import site_doc

    doc = site_doc(SITE)
    doc["executor"] = {"kind": "slurm", "slurm": {"gres_types": {"H900": "h9", "H100": "h9"}}}
    with pytest.raises(ConfigError) as err:
        parse_site("f.yaml", doc, DeviceCatalog.load())
    fields = {(p.field, p.reason.split(" (")[0]) for p in err.value.problems}
    assert ("executor.slurm.gres_types.H900", "unknown device model 'H900'") in fields
    assert ("executor.slurm.gres_types.H100", "GRES type 'h9' is also 'H900''s") in fields
