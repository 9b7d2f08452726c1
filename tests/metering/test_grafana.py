"""The Grafana dashboards' JSON (metering/grafana.py) and `cpn dashboards export`. Whether
every panel's query answers is tests/metering/test_prometheus.py's, on a real Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from metering import grafana
from tests.conftest import run_cpn

DOCS = Path(__file__).resolve().parents[2] / "docs"
# every metric the broker and the agents export, as docs/metrics.md's tables name them
DOCUMENTED = set(re.findall(r"`(cpn_[a-z_]+)`", (DOCS / "metrics.md").read_text()))


def metrics_in(expr: str) -> set[str]:
    names = set(re.findall(r"\b(cpn_[a-z_]+)", expr))
    # a histogram's series are its name's, with _bucket
    return {n.removesuffix("_bucket") for n in names}


def test_five_dashboards_each_with_its_uid_and_well_laid_out_panels() -> None:
    boards = grafana.dashboards()
    assert list(boards) == [
        "cpn-federation", "cpn-site", "cpn-tenant", "cpn-inference", "cpn-scheduler"
    ]  # fmt: skip
    for uid, board in boards.items():
        assert board["uid"] == uid and board["title"].startswith("cpn / ")
        assert board["templating"]["list"][0]["type"] == "datasource"
        ids = [p["id"] for p in board["panels"]]
        assert ids == list(range(1, len(ids) + 1)), uid
        cells: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, (uid, panel["title"])
            mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                    for y in range(pos["y"], pos["y"] + pos["h"])}  # fmt: skip
            assert not cells & mine, f"{uid}: {panel['title']} overlaps another panel"
            cells |= mine
            assert panel["targets"], (uid, panel["title"])
            refs = [t["refId"] for t in panel["targets"]]
            assert len(set(refs)) == len(refs), (uid, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_query_reads_documented_metrics_and_only_known_variables() -> None:
    for uid, board in grafana.dashboards().items():
        own = {v["name"] for v in board["templating"]["list"]}
        for title, expr in grafana.queries(board):
            names = metrics_in(expr)
            assert names, (uid, title, expr)
            unknown = {n for n in names if n not in DOCUMENTED and f"{n}_total" not in DOCUMENTED}
            assert not unknown, f"{uid}: {title}: {unknown} not in docs/metrics.md"
            for var in re.findall(r"\$(\w+)", expr):
                assert var.startswith("__") or var in own, (uid, title, var)


def test_a_variable_that_is_not_label_values_is_refused() -> None:
    board = grafana.dashboards()["cpn-site"]
    board["templating"]["list"][1]["definition"] = "query_result(up)"
    with pytest.raises(ValueError, match="variable site: not label_values"):
        list(grafana.variable_queries(board))


@pytest.mark.e2e  # runs cpn
def test_export_writes_one_json_file_per_dashboard(tmp_path: Path) -> None:
    out = tmp_path / "dashboards"
    result = run_cpn("dashboards", "export", str(out))
    assert result.returncode == 0, result.stderr
    written = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert written == {f"{uid}.json": board for uid, board in grafana.dashboards().items()}
    (tmp_path / "file").write_text("")
    refused = run_cpn("dashboards", "export", str(tmp_path / "file"))
    assert refused.returncode == 2 and refused.stderr.strip().endswith("not a directory")
