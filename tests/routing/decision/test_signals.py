"""Routing on the model server's own signals, pure: queue depth, KV-cache saturation, stale
signals, prefix affinity, and the reasons the route answer gives."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from broker.state.router import route_json
from routing.decision.choice import ChoiceMode, choose
from routing.decision.policy import Overflow, RoutingSettings, route
from routing.decision.ranking import Candidate, Exclusion
from routing.decision.selection import rank
from routing.decision.settings import ScoringSettings
from routing.decision.topology import Topology
from routing.errors import InvalidParameter
from routing.gateway.prefix import MAX_SCAN, header_key, prefix_key
from sites.model.status import ServiceEndpoint
from tests.routing.helpers import endpoint

NOW = 1000.0
DEFAULTS = RoutingSettings()


def topo(**rtts: float) -> Topology:
    topology = Topology()
    for site in rtts:
        topology.add_site(site)
    topology.set_client_region("city", rtts)
    return topology


def cand(site: str, **fields: Any) -> Candidate:
    fields.setdefault("signals", "vllm")
    fields.setdefault("signals_at", NOW - 1)
    return Candidate(endpoint=endpoint(site, **fields), region="east")


def go(cands: list[Candidate], rtts: dict[str, float], **kw: Any) -> Any:
    settings = kw.pop("settings", DEFAULTS)
    kw.setdefault("rng", random.Random(0))
    return route("llm", "city", cands, topo(**rtts), settings.policy(), settings, NOW, **kw)


# -- scoring ---------------------------------------------------------------------------------


def test_kv_cache_costs_nothing_below_the_knee_then_up_to_one_service_time() -> None:
    rtts = {"a": 10.0, "b": 10.0, "c": 10.0, "d": 10.0}
    cands = [
        cand("a"),  # reports no KV figure (an SGLang without token_usage, a /stats server)
        cand("b", kv_cache_usage=0.8),
        cand("c", kv_cache_usage=0.9),
        cand("d", kv_cache_usage=1.0),
    ]
    r = rank("llm", "city", cands, topo(**rtts), DEFAULTS.policy(), NOW)
    kv = {s.site: s.score.kv_ms for s in r.ranked}
    # L = 100 ms (helpers.endpoint), knee 0.8, weight 1: linear from 0 at 0.8 to L at 1.0
    assert kv == pytest.approx({"a": 0.0, "b": 0.0, "c": 50.0, "d": 100.0})
    assert [s.site for s in r.ranked] == ["a", "b", "c", "d"]
    d = r.get("d")
    assert d is not None
    assert d.total_ms == pytest.approx(10 + 100 + 100)


def test_queued_requests_raise_the_score_and_show_as_wait() -> None:
    # 8 slots: 10 held means 3 wait before this request, 3/8 of a service time
    r = rank("llm", "city", [cand("a", in_flight=8, queue=2)], topo(a=5), DEFAULTS.policy(), NOW)
    (a,) = r.ranked
    assert a.score.wait_ms == pytest.approx(100 * 3 / 8)
    assert a.score.service_ms == pytest.approx(100 + a.score.wait_ms)
    assert a.score.idle_ms == pytest.approx(5 + 100)


def test_a_loaded_server_loses_to_an_idle_one_at_similar_rtt() -> None:
    cands = [cand("busy", in_flight=8, queue=3), cand("idle", in_flight=1)]
    picks = {go(cands, {"busy": 8.0, "idle": 12.0}, rng=random.Random(i)).site for i in range(50)}
    assert picks == {"idle"}
    result = go(cands, {"busy": 8.0, "idle": 12.0})
    reasons = result.reasons()
    assert any("busy is 4.0 ms nearer but lost on its queue" in r for r in reasons), reasons


def test_kv_saturation_decides_between_equal_queues() -> None:
    cands = [cand("full-kv", kv_cache_usage=0.99), cand("roomy", kv_cache_usage=0.3)]
    result = go(cands, {"full-kv": 5.0, "roomy": 9.0})
    assert result.site == "roomy"
    assert any("lost on its KV cache" in r for r in result.reasons())


def test_stale_signals_count_as_saturated() -> None:
    settings = RoutingSettings(scoring=ScoringSettings(signals_stale_after_s=5))
    stale = cand("stale", signals_at=NOW - 6)  # reports idle, but 6 s ago
    fresh = cand("fresh", in_flight=8, queue=3, signals_at=NOW - 1)  # loaded, near full
    result = go([stale, fresh], {"stale": 1.0, "fresh": 40.0}, settings=settings)
    assert result.site == "fresh" and not result.overflow
    (excluded,) = result.ranking.excluded
    assert excluded.reason is Exclusion.full and "6 s old" in excluded.detail
    # nothing fresher can serve: the stale site takes the request as an overflow
    alone = go([stale], {"stale": 1.0}, settings=settings)
    assert alone.site == "stale" and alone.overflow
    admitted = alone.ranking.get("stale")
    assert admitted is not None
    assert admitted.score.kv_ms == pytest.approx(100.0)  # scored as saturated, KV cache too
    refused = go(
        [stale], {"stale": 1.0}, settings=settings.model_copy(update={"overflow": Overflow.refuse})
    )
    assert refused.site is None
    # a fresh full site is preferred to a stale one on overflow: a stale site counts as the
    # full cut-off (12 of 8 slots) and a full KV cache
    full = cand("full", in_flight=8, queue=4, kv_cache_usage=0.5)
    both = go([stale, full], {"stale": 1.0, "full": 1.0}, settings=settings)
    assert both.site == "full" and both.overflow


def test_old_records_without_signals_score_as_before() -> None:
    # an endpoint written before the signals existed: no kv, no signals_at, never stale
    old = ServiceEndpoint.model_validate_json(
        json.dumps(
            {"service": "llm", "site": "old", "model": "m", "url": "http://old:1",
             "max_concurrency": 8, "in_flight": 2, "queue": 0, "latency_ms": 100.0,
             "healthy": True, "updated_at": NOW - 1}
        )
    )  # fmt: skip
    assert (old.kv_cache_usage, old.signals, old.signals_at) == (None, None, None)
    r = rank("llm", "city", [Candidate(endpoint=old, region="east")], topo(old=3),
             DEFAULTS.policy(), NOW + 3600)  # fmt: skip
    assert r.ranked == () and r.excluded[0].reason is Exclusion.unhealthy  # the record's age
    r = rank("llm", "city", [Candidate(endpoint=old, region="east")], topo(old=3),
             DEFAULTS.policy(), NOW)  # fmt: skip
    (s,) = r.ranked
    assert (s.score.kv_ms, s.total_ms) == (0.0, pytest.approx(103.0))


@pytest.mark.parametrize(
    ("field", "value"),
    [("signals_stale_after_s", 0), ("kv_cache_knee", 1.0), ("kv_cache_weight", -1)],
)
def test_bad_scoring_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RoutingSettings.model_validate({"scoring": {field: value}})


# -- prefix affinity -------------------------------------------------------------------------

SITES = {"a": 10.0, "b": 12.0, "c": 14.0}


def test_one_prefix_one_site_and_prefixes_spread() -> None:
    cands = [cand(s) for s in SITES]
    homes = {}
    for i in range(60):
        key = f"p:{i}"
        picks = {go(cands, SITES, prefix_key=key, rng=random.Random(j)).site for j in range(5)}
        assert len(picks) == 1  # the same prefix always lands on the same site
        homes[key] = picks.pop()
    spread = {site: list(homes.values()).count(site) for site in SITES}
    assert all(n >= 10 for n in spread.values()), spread  # not all on the nearest


def test_the_home_keeps_its_prefix_while_its_load_allows_then_spills() -> None:
    idle = [cand(s) for s in SITES]
    key = next(f"p:{i}" for i in range(100) if go(idle, SITES, prefix_key=f"p:{i}").site == "c")
    # c, 4 ms further than a, with some queue: within prefix_slack_ms (50) of the best
    busy = [cand("a"), cand("b"), cand("c", in_flight=8, queue=2)]  # wait 3/8 * 100 = 37.5
    kept = go(busy, SITES, prefix_key=key)
    assert kept.site == "c" and kept.choice.mode is ChoiceMode.prefix
    assert kept.choice.home is None
    assert "the prefix's home" in kept.reasons()[0]
    # saturated: 8 + 3 queued (50 ms of waiting) and a full KV cache; the request spills
    hot = [cand("a"), cand("b"), cand("c", in_flight=8, queue=3, kv_cache_usage=0.95)]
    spilled = go(hot, SITES, prefix_key=key)
    assert spilled.site in {"a", "b"} and spilled.choice.home == "c"
    assert spilled.choice.mode is not ChoiceMode.prefix
    assert "spilled from the prefix's home c" in spilled.reasons()[0]
    # the home's pool is set by unloaded scores, so load does not move the key elsewhere
    assert spilled.choice.home == kept.site


def test_a_prefix_key_neither_reads_nor_moves_the_hysteresis_state() -> None:
    cands = [cand(s) for s in SITES]
    key = next(f"p:{i}" for i in range(100) if go(cands, SITES, prefix_key=f"p:{i}").site == "b")
    r = go(cands, SITES, prefix_key=key, previous="a")
    assert r.site == "b" and r.previous == "a"


def test_a_session_key_wins_over_a_prefix_key() -> None:
    cands = [cand(s) for s in SITES]
    with_both = go(cands, SITES, session_key="user-1", prefix_key="p:1")
    assert with_both.choice.mode in (ChoiceMode.affinity, ChoiceMode.sticky)
    assert with_both.site == go(cands, SITES, session_key="user-1").site


def test_a_far_site_is_not_a_prefix_home() -> None:
    # affinity_slack_ms (100) bounds the home pool by unloaded score: 300 ms away is out
    cands = [cand("near"), cand("far")]
    sites = {"near": 5.0, "far": 300.0}
    assert {go(cands, sites, prefix_key=f"p:{i}").site for i in range(30)} == {"near"}


def test_bad_prefix_slack_names_the_field() -> None:
    r = rank("llm", "city", [cand("a")], topo(a=1), DEFAULTS.policy(), NOW)
    with pytest.raises(InvalidParameter) as err:
        choose(
            r, rng=random.Random(0), prefix_key="p:1", prefix_slack_ms=float("nan"),
            hysteresis_ms=0, near_best_ms=0, near_best_ratio=0, affinity_slack_ms=None,
        )  # fmt: skip
    assert err.value.field == "prefix_slack_ms"
    with pytest.raises(ValueError, match="prefix_slack_ms"):
        RoutingSettings(prefix_slack_ms=-1)


def test_route_json_shows_the_signals_and_the_reasons() -> None:
    cands = [cand("a", in_flight=8, queue=3, kv_cache_usage=0.97), cand("b", kv_cache_usage=0.1)]
    body = route_json(go(cands, {"a": 2.0, "b": 6.0}))
    assert body["site"] == "b" and body["home"] is None
    a = next(c for c in body["candidates"] if c["site"] == "a")
    assert (a["running"], a["waiting"], a["kv_cache_usage"], a["signals_age_s"]) == (
        8, 3, 0.97, 1.0
    )  # fmt: skip
    assert a["total_ms"] == pytest.approx(
        a["network_ms"] + a["service_ms"] + a["kv_ms"] + a["penalty_ms"], abs=0.01
    )
    assert any("a is 4.0 ms nearer but lost on" in r for r in body["reasons"])
    assert any(
        r.startswith("b: 0 running, 0 waiting of 8 slots, KV cache 10%") for r in body["reasons"]
    )


def test_overflow_with_a_prefix_key_queues_where_it_waits_least() -> None:
    settings = RoutingSettings(overflow=Overflow.queue)
    cands = [cand("a", in_flight=8, queue=6), cand("b", in_flight=8, queue=9)]
    r = go(cands, {"a": 5.0, "b": 5.0}, prefix_key="p:7", settings=settings)
    assert r.overflow and r.site in {"a", "b"}


# -- the prefix key --------------------------------------------------------------------------


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


SYSTEM = "You are a careful assistant for the operations team. " * 8  # > 256 bytes


def test_prompts_sharing_a_prefix_share_a_key() -> None:
    a = prefix_key(body(model="m", prompt=SYSTEM + "first question"), 256)
    b = prefix_key(body(prompt=SYSTEM + "another one", max_tokens=9), 256)
    c = prefix_key(body(prompt="Another system prompt entirely. " * 10), 256)
    assert a is not None and a == b and a != c
    # whitespace after the key does not matter; compact JSON gives the same key
    compact = json.dumps({"prompt": SYSTEM + "x"}, separators=(",", ":")).encode()
    assert prefix_key(compact, 256) == a


def test_chat_messages_key_on_their_first_bytes() -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "bye"}]
    assert prefix_key(body(messages=msgs), 256) == prefix_key(body(messages=other), 256)
    assert prefix_key(body(messages=msgs), 256) != prefix_key(body(prompt=SYSTEM), 256)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json at all",
        body(prompt="hi"),  # short: little to reuse
        body(prompt=""),
        body(messages=[]),
        body(model="m", input="x" * 400),  # neither field
        b'{"prompt" 1}',
        b" " * MAX_SCAN + body(prompt=SYSTEM),  # the field beyond what is scanned
    ],
)
def test_no_key_without_a_long_enough_prompt(raw: bytes) -> None:
    assert prefix_key(raw, 256) is None


def test_the_header_key_and_the_off_switch() -> None:
    assert header_key("  tenant-42/doc-7 ") == "h:tenant-42/doc-7"
    assert header_key("   ") is None
    long_key = header_key("x" * 1000)
    assert long_key is not None and len(long_key) < 40
    assert prefix_key(body(prompt=SYSTEM), 0) is None
