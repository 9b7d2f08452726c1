"""`cpn tenants`, `cpn tenant set|show|delete` and `cpn tenants apply` against a real broker;
how `set` merges its flags into the policy it reads."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cpn.cli import build_parser, main
from cpn.cli_base import UsageError
from cpn.tenant_cli import FlagError, inference_line, merged_policy
from cpn.token_cli import token_limits
from sites.registry.client import Registry
from tests.broker.apiserver import start_api_broker
from tests.conftest import REPO, Processes, cpn_cmd


def set_args(*argv: str) -> Any:
    return build_parser().parse_args(["tenant", "set", "t", *argv])


def test_set_changes_what_its_flags_name_and_keeps_the_rest() -> None:
    base = {
        "quota": {"gpus": 8, "gpu_models": {"H100": 4}, "cpu": 64},
        "regions": {"east": {"gpus": 2}},
        "cohort": "lab",
        "weight": 2.0,
        "budget": {"usd_per_month": 100.0, "gpu_hours": None, "window": 86400.0},
    }
    args = set_args(
        "--gpus", "16", "--cpu", "none", "--gpu-model", "A100=2", "--region", "west:gpus=1,cpu=8",
        "--region", "east:none", "--borrowing-limit-gpus", "4", "--gpu-hours", "50",
        "--window", "7d", "--mem-gb", "512.5",
    )  # fmt: skip
    got = merged_policy(base, args)
    assert got["quota"] == {"gpus": 16, "gpu_models": {"H100": 4, "A100": 2}, "mem_gb": 512.5}
    assert got["regions"] == {"west": {"gpus": 1, "cpu": 8}}
    assert got["cohort"] == "lab" and got["weight"] == 2.0
    assert got["borrowing_limit"] == {"gpus": 4}
    assert got["budget"] == {"usd_per_month": 100.0, "gpu_hours": 50.0, "window": "7d"}
    assert base["quota"]["gpus"] == 8  # the input is not changed
    unset = merged_policy(got, set_args("--usd-per-month", "none", "--gpu-hours", "none"))
    assert unset["budget"] is None
    assert merged_policy({"gpus": 3}, set_args("--jobs", "5"))["quota"] == {"gpus": 3, "jobs": 5}
    assert merged_policy({}, set_args("--cohort", "none", "--window", "3600"))["cohort"] is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--gpus", "many"), "--gpus: expected a whole number"),
        (("--gpus", "1.5"), "--gpus: expected a whole number"),
        (("--gpu-model", "H100"), "--gpu-model: expected MODEL=N"),
        (("--region", "east"), "--region: expected REGION:KEY=N"),
        (("--region", "east:tpus=1"), "unknown key 'tpus'"),
        (("--weight", "none"), "--weight: expected a number"),
    ],
)
def test_a_bad_flag_is_named(argv: tuple[str, ...], says: str) -> None:
    with pytest.raises(FlagError, match=says):
        merged_policy({}, set_args(*argv))


def cpn(broker: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The real command line, in its own process."""
    env = {**os.environ, "CPN_BROKER": broker}
    return subprocess.run(
        cpn_cmd(*args), capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )


def test_set_changes_the_inference_section() -> None:
    base = {"quota": {"gpus": 1}, "inference": {"requests_per_minute": 10, "priority": 3}}
    got = merged_policy(base, set_args("--tpm", "5000", "--inference-usd-per-month", "20"))
    assert got["inference"] == {
        "requests_per_minute": 10,
        "priority": 3,
        "tokens_per_minute": 5000,
        "budget": {"usd_per_month": 20.0},
    }
    gone = merged_policy(got, set_args("--rpm", "none", "--tpm", "none", "--priority", "none",
                                       "--inference-usd-per-month", "none"))  # fmt: skip
    assert gone["inference"] is None
    made = merged_policy({}, set_args("--priority", "-5", "--inference-tokens-per-month", "9"))
    assert made["inference"] == {"priority": -5, "budget": {"tokens_per_month": 9}}
    with pytest.raises(FlagError, match="--rpm: expected a whole number"):
        merged_policy({}, set_args("--rpm", "1.5"))


def test_the_inference_cell() -> None:
    limits_only = {
        "priority": -5,
        "month": "2026-12",
        "requests_per_minute": {"used": None, "limit": 600},
        "tokens_per_minute": {"used": None, "limit": 200_000},
        "tokens_this_month": {"used": None, "limit": None},
        "usd_this_month": {"used": None, "limit": 2000.0},
        "tokens": {},
    }
    assert inference_line(limits_only) == "600 rpm, 200k tpm, $2,000/mo, prio -5"
    counted = {
        **limits_only,
        "priority": 0,
        "requests_per_minute": {"used": 12, "limit": 600},
        "tokens_per_minute": {"used": 45_500, "limit": 200_000},
        "usd_this_month": {"used": 12.5, "limit": 2000.0},
    }
    assert inference_line(counted) == "12/600 rpm, 45.5k/200k tpm, $12.50/$2,000/mo"
    assert inference_line(None) == "-"


def test_token_limit_flags() -> None:
    def parse(*argv: str) -> Any:
        args = build_parser().parse_args(["token", "create", "--role", "tenant-user", *argv])
        return token_limits(args)

    assert parse() is None
    got = parse("--rpm", "10", "--tokens-per-month", "1000")
    assert got.requests_per_minute == 10 and got.budget.tokens_per_month == 1000
    for argv, flag in (
        ((("--tpm", "0"),), "--tpm"),
        ((("--usd-per-month", "x"),), "--usd-per-month"),
    ):
        with pytest.raises(UsageError, match=f"^{flag}: "):
            parse(*argv[0])


@dataclass
class Cli:
    """`cpn` in this process (as tests/broker/plan/test_plan.py runs `cpn plan`): a second each
    saved on the interpreter's start and imports."""

    capsys: pytest.CaptureFixture[str]

    def __call__(self, *argv: str) -> subprocess.CompletedProcess[str]:
        self.capsys.readouterr()
        code = main(list(argv))
        out, err = self.capsys.readouterr()
        return subprocess.CompletedProcess(list(argv), code, out, err)


@pytest.mark.e2e
def test_the_tenant_commands_against_a_broker(
    registry: Registry,
    processes: Processes,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = start_api_broker(registry.url, processes, tmp_path)
    monkeypatch.setenv("CPN_BROKER", api.url)
    run = Cli(capsys)
    made = run("tenant", "set", "t-cli", "--gpus", "8", "--weight", "2",
               "--region", "east:gpus=2", "--usd-per-month", "100")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("tenant t-cli created: GPUs 0/8, weight 2"), made.stdout
    again = run("tenant", "set", "t-cli", "--gpus", "16", "--cohort", "research")
    assert again.returncode == 0 and "updated" in again.stdout, again.stderr
    shown = json.loads(run("tenant", "show", "t-cli", "-o", "json").stdout)
    policy = shown["policy"]  # the first set's weight, region and budget are kept
    assert (
        policy["quota"]["gpus"] == 16 and policy["weight"] == 2 and policy["cohort"] == "research"
    )
    assert policy["regions"] == {"east": {**policy["regions"]["east"], "gpus": 2}}
    assert shown["budget"]["usd_total"] == 100
    table = cpn(api.url, "tenants")  # the real command line
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["TENANT", "WEIGHT", "COHORT", "GPUS"]
    mine = next(r for r in rows if r.startswith("t-cli ")).split()
    assert mine[1:4] == ["2", "research", "0/16"], mine
    assert any(r.startswith("startup ") and "$20,000/20,000" in r for r in rows), rows
    described = run("tenant", "show", "t-cli")
    assert "Policy:" in described.stdout and "usd_per_month: 100" in described.stdout
    assert "Inference:   not limited" in described.stdout
    # inference limits: set by flags, shown by both commands
    limited = run("tenant", "set", "t-cli", "--rpm", "100", "--tpm", "5000", "--priority", "-5")
    assert limited.returncode == 0, limited.stderr
    shown = json.loads(run("tenant", "show", "t-cli", "-o", "json").stdout)
    assert shown["policy"]["inference"]["requests_per_minute"] == 100
    assert shown["inference"]["priority"] == -5
    assert shown["inference"]["tokens_per_minute"]["limit"] == 5000
    described = run("tenant", "show", "t-cli")
    assert "Inference:   priority -5" in described.stdout, described.stdout
    assert "requests/min: " in described.stdout and "limit 100" in described.stdout
    rows = cpn(api.url, "tenants").stdout.splitlines()
    row = next(r for r in rows if r.startswith("t-cli "))
    # "100 rpm": the limit alone; "0/100 rpm" where the broker counts (InferenceLimits wired)
    assert "100 rpm, " in row and "5k tpm, prio -5" in row, row
    startup = next(r for r in rows if r.startswith("startup "))
    assert "2M tpm, " in startup and "$5,000/mo" in startup, startup
    refused = run("tenant", "set", "t-cli", "--priority", "2000")
    assert refused.returncode == 2 and "(field: inference.priority)" in refused.stderr, refused

    # a user error exits 2 with one line: a bad flag, a field the broker refuses, no tenant
    failed = cpn(api.url, "tenant", "set", "t-cli", "--cohort", "nope")
    assert failed.returncode == 2, (failed.stdout, failed.stderr)
    assert failed.stderr.strip().splitlines() == [
        "cpn: error: unknown cohort 'nope' (cohorts: research) (field: cohort)"
    ], failed.stderr
    for argv, says in (
        (("tenant", "set", "t-cli", "--gpus", "x"), "--gpus"),
        (("tenant", "set", "t-cli", "--gpus", "-1"), "(field: quota.gpus)"),
        (("tenant", "show", "nobody"), "no tenant 'nobody'"),
        (("tenants", "apply"), "needs FILE"),
    ):
        failed = run(*argv)
        assert failed.returncode == 2, (argv, failed.stdout, failed.stderr)
        assert len(failed.stderr.strip().splitlines()) == 1 and says in failed.stderr, failed.stderr

    # a whole file: cpn tenants apply, and cpn tenant set -f
    file = yaml.safe_load((REPO / "configs" / "tenants.yaml").read_text())
    file["tenants"]["from-file"] = {"quota": {"gpus": 1}}
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(file))
    applied = run("tenants", "apply", str(path))
    assert applied.returncode == 0 and "4 tenant(s), 1 cohort(s)" in applied.stdout, applied
    names = {t["tenant"] for t in json.loads(run("tenants", "-o", "json").stdout)}
    assert names == {"ai-lab", "hpc-center", "startup", "from-file"}  # t-cli is gone
    one = tmp_path / "policy.yaml"
    one.write_text("quota: {gpus: 3}\nbudget: {gpu_hours: 9, window: 7d}\n")
    put = run("tenant", "set", "from-file", "-f", str(one), "--weight", "4")
    assert put.returncode == 0 and "GPUs 0/3, weight 4" in put.stdout, put
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: {a: {quota: {gpus: -1}}}\n")
    refused = run("tenants", "apply", str(bad))
    assert refused.returncode == 2 and "field: tenants.a.quota.gpus" in refused.stderr, refused
    deleted = run("tenant", "delete", "from-file")
    assert deleted.returncode == 0 and "deleted" in deleted.stdout, deleted
