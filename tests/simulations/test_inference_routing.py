"""The simulator routes inference with the gateway's policy: overflow queues, settings apply."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from simulations.engine import Simulation
from simulations.scenario import load_scenario
from sites.model.errors import ConfigError

# qwen2.5-7b-instruct in configs/standin.yaml: median 120 ms, p99 400 ms -> lognormal mean
_SIGMA = math.log(400 / 120) / 2.3263478740408408
MEAN_S = 0.120 * math.exp(_SIGMA**2 / 2)
SLOTS = 8
RATE = 120.0  # requests/s: about twice what 8 slots serve, past the routing cut-off (1.5 c)


@pytest.fixture
def overloaded(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path]
) -> Callable[..., dict[str, Any]]:
    def run(routing: dict[str, Any] | None = None) -> dict[str, Any]:
        site = {
            "region": "jing-jin-ji",
            "coordinates": {"lat": 40.8, "lon": 114.9},
            "services": [
                {
                    "name": "chat",
                    "model": "qwen2.5-7b-instruct",
                    "url": "http://127.0.0.1:1",
                    "max_concurrency": SLOTS,
                }
            ],
        }
        make_configs({"zhangjiakou": site}, clients=True)
        body: dict[str, Any] = {
            "name": "t",
            "federation": {"configs": "configs"},
            "horizon": "1h",
            "seed": 3,
            "inference_step_s": "10m",
            "workloads": [
                {
                    "kind": "inference",
                    "name": "chat",
                    "service": "chat",
                    "requests_per_s": {"beijing": RATE},
                    "slo_ms": 500,
                }
            ],
        }
        if routing is not None:
            body["routing"] = routing
        return Simulation(load_scenario(write_scenario(body))).run()["inference"]

    return run


def test_overflow_queues_on_the_full_site_as_the_gateway_does(
    overloaded: Callable[..., dict[str, Any]],
) -> None:
    queued = overloaded()
    refused = overloaded({"overflow": "refuse"})
    offered = RATE * MEAN_S / SLOTS  # the site's load if every request reaches it
    # queued: every slice reaches the site, whose serving model sees the whole overload
    assert max(queued["series"]["site_load"]["zhangjiakou"]) == pytest.approx(offered, rel=0.02)
    # refused: routing stops at the cut-off, in_flight + queue >= 1.5 x max_concurrency
    assert max(refused["series"]["site_load"]["zhangjiakou"]) < 1.5 + 1 / SLOTS
    q, r = queued["regions"]["beijing"], refused["regions"]["beijing"]
    # the site serves at most 98 % of its slots either way: what is lost differs in where
    assert q["dropped"] == pytest.approx(r["dropped"], rel=0.05)
    assert q["dropped"] > 0.4 * q["requests"]


def test_scenario_routing_settings_are_validated(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path]
) -> None:
    make_configs({"one": {}})
    body = {
        "name": "t",
        "federation": {"configs": "configs"},
        "horizon": "1h",
        "routing": {"near_best_ratio": 2},
        "workloads": [
            {"kind": "batch", "name": "j", "arrivals": {"process": "poisson", "rate_per_hour": 1}}
        ],
    }
    with pytest.raises(ConfigError) as caught:
        load_scenario(write_scenario(body))
    assert [p.field for p in caught.value.problems] == ["routing.near_best_ratio"]
