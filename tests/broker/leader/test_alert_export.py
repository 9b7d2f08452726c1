"""The Prometheus alerting-rules file: in sync with configs/, accepted by `promtool check
rules`, and reading only metrics the broker and the agents really export."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from broker.leader.alert_export import METRICS, rules_yaml
from broker.leader.alerts import AlertMetrics
from broker.model.alert_rules import AlertSettings
from broker.placement.settings import load_settings
from broker.state.metrics import BrokerMetrics
from broker.state.view import View
from broker.state.view_cache import ViewCollector
from sites.model.capacity import Capacity
from sites.model.snapshot import Snapshot
from sites.model.status import LinkStatus, SiteStatus
from tests.conftest import CONFIGS, REPO, run_cpn
from tests.routing.helpers import spec

RULES = CONFIGS / "prometheus-rules.yaml"


def promtool() -> str:
    found = shutil.which("promtool")
    installer = REPO / ".ci" / "install-prometheus"
    if found is None and installer.exists():
        subprocess.run([str(installer)], capture_output=True, timeout=300, check=False)
        found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool: .ci/install-prometheus could not install the prometheus package")
    return found


@pytest.mark.e2e
def test_the_checked_in_rules_file_is_cpn_alerts_rules_of_configs() -> None:
    result = run_cpn("alerts", "rules", "--config-dir", str(CONFIGS))
    assert result.returncode == 0, result.stderr
    expected = rules_yaml(load_settings(CONFIGS / "broker.yaml").alerts)
    assert result.stdout == expected
    assert RULES.read_text() == expected, (
        "regenerate: cpn alerts rules > configs/prometheus-rules.yaml"
    )


@pytest.mark.e2e
def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    tool = promtool()
    every = AlertSettings.model_validate(
        {
            "budget": {"monthly_usd": {"ai-lab": 100}},
            "slo": {"latency_ms": {"llm": 500}},
            "site_down": {"for_s": 0.5},
        }
    )
    (tmp_path / "all.yaml").write_text(rules_yaml(every))
    for path in (RULES, tmp_path / "all.yaml"):
        checked = subprocess.run(
            [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 13 rules found" in checked.stdout, checked.stdout  # backup_stale: 13th


def test_every_metric_the_rules_read_is_exported() -> None:
    from sites.agent.metrics import AgentMetrics

    snap = Snapshot(revision=1)
    snap.specs["a"] = spec("a", "east", 30, 120)
    broker = BrokerMetrics()
    broker.watch(ViewCollector(lambda: View(sites=snap)))
    agent = AgentMetrics("a")
    cap = Capacity(devices={"H100": 8}, cpu_cores=8, mem_gb=64)
    agent.observe_status(SiteStatus.model_construct(site="a", capacity=cap, free=cap, gpus=()))
    agent.observe_links(
        [
            LinkStatus(
                src="a", dst="b", rtt_ms=5.0, rtt_median_ms=5.0, jitter_ms=0.1, loss_pct=0.0,
                samples=5, method="http", emulated=True, measured_at=0.0,
            )
        ]
    )  # fmt: skip
    alerts = CollectorRegistry()
    AlertMetrics(alerts, _NoAlerts())  # type: ignore[arg-type]
    exported = {
        family.name
        for registry in (broker.registry, agent.registry, alerts)
        for family in registry.collect()
    }
    missing = sorted(set(METRICS.values()) - exported)
    assert not missing, missing


class _NoAlerts:
    def records(self) -> list[object]:
        return []
