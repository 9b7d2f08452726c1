"""routing.decision.selection: scoring by hand numbers, exclusions, p2c, hysteresis, session
affinity."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Any

import pytest

from routing.decision.candidates import candidates_from_snapshot
from routing.decision.choice import Choice, ChoiceMode, choose
from routing.decision.policy import RoutingSettings
from routing.decision.ranking import Candidate, Exclusion, Ranking
from routing.decision.selection import expected_service_ms, rank
from routing.decision.settings import Policy, ScoringSettings, TenantPolicy
from routing.decision.topology import Topology
from routing.errors import CandidateError, InvalidParameter
from sites.model.snapshot import Snapshot
from sites.model.status import Cordon, SiteState
from tests.routing.helpers import endpoint, link, spec

NOW = 1000.0


def topo(**rtts: float) -> Topology:
    """Client region 'city' with a direct access link of the given RTT to each site."""
    topology = Topology()
    for site in rtts:
        topology.add_site(site)
    topology.set_client_region("city", rtts)
    return topology


_CANDIDATE_ARGS = frozenset(f.name for f in dataclasses.fields(Candidate) if f.init)


def cand(site: str, region: str = "east", **fields: Any) -> Candidate:
    opts = {k: fields.pop(k) for k in list(fields) if k in _CANDIDATE_ARGS}
    return Candidate(endpoint=endpoint(site, **fields), region=region, **opts)


def ranking_of(cands: list[Candidate], rtts: dict[str, float], **policy: Any) -> Ranking:
    return rank("llm", "city", cands, topo(**rtts), Policy(**policy), NOW)


DEFAULTS = RoutingSettings()


def pick(ranking: Ranking, **kwargs: Any) -> Choice | None:
    """choose() with RoutingSettings' band, hysteresis and slack unless given."""
    args: dict[str, Any] = {
        "hysteresis_ms": DEFAULTS.hysteresis_ms,
        "near_best_ms": DEFAULTS.near_best_ms,
        "near_best_ratio": DEFAULTS.near_best_ratio,
        "affinity_slack_ms": DEFAULTS.affinity_slack_ms,
    }
    args.update(kwargs)
    return choose(ranking, **args)


def equal_sites(n: int, rtt: float = 10.0) -> tuple[list[Candidate], dict[str, float]]:
    sites = [f"s{i}" for i in range(n)]
    return [cand(s) for s in sites], dict.fromkeys(sites, rtt)


# -- scoring ---------------------------------------------------------------------------------


def test_score_parts_by_hand() -> None:
    a = cand("a", max_concurrency=4, in_flight=4, queue=1, latency_ms=100, error_rate=0.1)
    b = cand("b", max_concurrency=8, in_flight=3, latency_ms=80, draining=True)
    ranking = ranking_of([b, a], {"a": 10, "b": 30})
    sa, sb = ranking.ranked
    # L: both serve model "m" and report within 2x of each other: the median, 90 ms, for both
    # a: 10 ms network; 5 ahead of 4 slots -> waits for 2 departures: 90 * (1 + 2/4) = 135;
    # 10 % errors * 1000 ms = 100 ms penalty
    assert (sa.site, sa.score.network_ms, sa.score.service_ms, sa.score.penalty_ms) == (
        "a",
        10,
        135,
        100,
    )
    assert sa.total_ms == 245
    # b: a free slot -> 90 ms; draining -> +10 000 ms
    assert (sb.score.network_ms, sb.score.service_ms, sb.score.penalty_ms) == (30, 90, 10_000)
    assert sb.total_ms == 10_120
    assert ranking.best is sa and ranking.get("b") is sb and ranking.get("zz") is None
    assert ranking.topology_version > 0 and ranking.excluded == ()


def test_service_model_queueing_and_default_latency() -> None:
    settings = ScoringSettings(default_latency_ms=50)
    assert expected_service_ms(endpoint("a", max_concurrency=2, latency_ms=None), settings) == 50
    ep = endpoint("a", max_concurrency=2, in_flight=1, latency_ms=40)
    assert expected_service_ms(ep, settings) == 40  # the last free slot
    ep = endpoint("a", max_concurrency=2, in_flight=2, queue=1, latency_ms=40)
    assert expected_service_ms(ep, settings) == 40 * (1 + 2 / 2)


def test_network_uses_the_topology_path() -> None:
    topology = Topology()
    for site in ("a", "b"):
        topology.add_site(site)
    topology.set_client_region("city", {"a": 5})
    topology.update_links([link("a", "b", 20)])
    ranking = rank("llm", "city", [cand("b")], topology, Policy(), NOW)
    assert ranking.ranked[0].score.network_ms == 25


def test_cordoned_site_drains() -> None:
    ranking = ranking_of([cand("a", site_state=SiteState.cordoned)], {"a": 10})
    assert ranking.ranked[0].score.penalty_ms == 10_000


# -- exclusions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("candidate", "policy", "reason", "detail"),
    [
        (cand("x", service="other"), {}, Exclusion.wrong_service, "serves 'other'"),
        (
            cand("x", region="abroad"),
            {"sovereignty": {"city": frozenset({"east"})}},
            Exclusion.sovereignty,
            "region 'abroad' may not serve client region 'city'",
        ),
        (
            cand("x", region="west"),
            {"tenant": TenantPolicy(allowed_regions=frozenset({"east"}))},
            Exclusion.tenant_policy,
            "not in allowed_regions",
        ),
        (
            cand("x", region="west"),
            {"tenant": TenantPolicy(denied_regions=frozenset({"west"}))},
            Exclusion.tenant_policy,
            "is in denied_regions",
        ),
        (
            cand("x"),
            {"tenant": TenantPolicy(allowed_sites=frozenset({"ok"}))},
            Exclusion.tenant_policy,
            "site 'x' is not in allowed_sites",
        ),
        (
            cand("x"),
            {"tenant": TenantPolicy(denied_sites=frozenset({"x"}))},
            Exclusion.tenant_policy,
            "site 'x' is in denied_sites",
        ),
        (cand("x", site_state=SiteState.down), {}, Exclusion.unhealthy, "site is down"),
        (cand("x", healthy=False), {}, Exclusion.unhealthy, "endpoint reports unhealthy"),
        (cand("x", updated_at=NOW - 31), {}, Exclusion.unhealthy, "31 s old"),
        (cand("x", ejected_until=NOW + 2.5), {}, Exclusion.unhealthy, "2.5 s more"),
        (cand("x", error_rate=0.5), {}, Exclusion.unhealthy, "error rate 50% >= "),
        (
            cand("x", max_concurrency=4, in_flight=4, queue=2),
            {},
            Exclusion.full,
            "4 in flight + 2 queued >= 6",
        ),
        (cand("nowhere"), {}, Exclusion.no_route, "no path from client region 'city'"),
        # the first reason in the documented order wins
        (
            cand("x", region="abroad", site_state=SiteState.down),
            {"sovereignty": {"city": frozenset({"east"})}},
            Exclusion.sovereignty,
            "may not serve",
        ),
    ],
)
def test_each_exclusion_reason(
    candidate: Candidate, policy: dict[str, Any], reason: Exclusion, detail: str
) -> None:
    ranking = ranking_of([candidate, cand("ok")], {"x": 10, "ok": 10}, **policy)
    assert [s.site for s in ranking.ranked] == ["ok"]
    (excluded,) = ranking.excluded
    assert (excluded.site, excluded.reason) == (candidate.site, reason)
    assert detail in excluded.detail
    assert ranking.reasons() == {candidate.site: reason}


def test_expired_ejection_and_fresh_report_are_fine() -> None:
    ranking = ranking_of(
        [cand("x", ejected_until=NOW - 1, updated_at=NOW - 29, error_rate=0.49)], {"x": 1}
    )
    assert [s.site for s in ranking.ranked] == ["x"]


def test_bad_candidates_are_rejected() -> None:
    with pytest.raises(CandidateError, match="error_rate"):
        cand("x", error_rate=1.5)
    with pytest.raises(CandidateError, match="candidate twice"):
        ranking_of([cand("x"), cand("x")], {"x": 1})
    assert issubclass(CandidateError, ValueError)  # callers that caught ValueError still do


# -- power of two choices ----------------------------------------------------------------------


def test_p2c_spreads_load_among_equal_sites_and_never_picks_a_clearly_worse_one() -> None:
    cands, rtts = equal_sites(3)
    cands.append(cand("far"))
    rtts["far"] = 60.0  # 50 ms worse than the others: outside the near-best band
    ranking = ranking_of(cands, rtts)
    rng = random.Random(42)
    counts: Counter[str] = Counter()
    for _ in range(10_000):
        choice = pick(ranking, rng=rng)
        assert choice is not None and choice.mode is ChoiceMode.p2c
        assert choice.pool == ("s0", "s1", "s2")
        counts[choice.site] += 1
    assert counts["far"] == 0
    for site in ("s0", "s1", "s2"):
        assert 3000 < counts[site] < 3700, counts


def test_p2c_prefers_the_less_loaded_of_near_best_sites() -> None:
    ranking = ranking_of(
        [cand("busy", in_flight=6), cand("idle", in_flight=1)], {"busy": 10, "idle": 15}
    )
    rng = random.Random(0)
    assert {pick(ranking, rng=rng).site for _ in range(100)} == {"idle"}  # type: ignore[union-attr]


def test_near_best_band_is_absolute_or_relative() -> None:
    cands = [cand("a", latency_ms=100), cand("b", latency_ms=100)]
    ranking = ranking_of(cands, {"a": 0, "b": 25})  # totals 100 and 125
    rng = random.Random(0)
    narrow = pick(ranking, rng=rng, near_best_ms=10, near_best_ratio=0.1)
    assert narrow is not None and (narrow.mode, narrow.pool) == (ChoiceMode.single, ("a",))
    wide = pick(ranking, rng=rng, near_best_ms=10, near_best_ratio=0.3)
    assert wide is not None and wide.pool == ("a", "b")
    wide = pick(ranking, rng=rng, near_best_ms=25, near_best_ratio=0)
    assert wide is not None and wide.pool == ("a", "b")


def test_choices_are_deterministic_for_a_seed() -> None:
    cands, rtts = equal_sites(5)
    ranking = ranking_of(cands, rtts)

    def run(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [pick(ranking, rng=rng).site for _ in range(50)]  # type: ignore[union-attr]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_nothing_to_choose() -> None:
    ranking = ranking_of([cand("x", healthy=False)], {"x": 1})
    assert pick(ranking, rng=random.Random(0)) is None
    assert pick(ranking, rng=random.Random(0), key="k") is None


def test_bad_choice_parameters() -> None:
    ranking = ranking_of([cand("x")], {"x": 1})
    with pytest.raises(InvalidParameter, match="hysteresis_ms") as exc:
        pick(ranking, rng=random.Random(0), hysteresis_ms=-1)
    assert exc.value.field == "hysteresis_ms"
    with pytest.raises(InvalidParameter, match="near_best_ratio") as exc:
        pick(ranking, rng=random.Random(0), near_best_ratio=float("nan"))
    assert exc.value.field == "near_best_ratio" and isinstance(exc.value, ValueError)
    for name, bad in [("near_best_ms", float("inf")), ("affinity_slack_ms", -0.5)]:
        with pytest.raises(InvalidParameter) as exc:
            pick(ranking, rng=random.Random(0), **{name: bad})
        assert exc.value.field == name


# -- hysteresis ------------------------------------------------------------------------------


def test_hysteresis_keeps_the_previous_site_within_the_threshold() -> None:
    ranking = ranking_of([cand("old"), cand("new")], {"old": 30, "new": 12})  # 18 ms better
    choice = pick(ranking, rng=random.Random(0), previous="old", hysteresis_ms=20)
    assert choice is not None and (choice.site, choice.mode) == ("old", ChoiceMode.sticky)


def test_hysteresis_switches_beyond_the_threshold() -> None:
    ranking = ranking_of([cand("old"), cand("new")], {"old": 35, "new": 12})  # 23 ms better
    choice = pick(ranking, rng=random.Random(0), previous="old", hysteresis_ms=20)
    assert choice is not None and (choice.site, choice.mode) == ("new", ChoiceMode.single)


def test_a_failed_previous_site_is_left_at_once() -> None:
    ranking = ranking_of([cand("old", healthy=False), cand("new")], {"old": 1, "new": 12})
    choice = pick(ranking, rng=random.Random(0), previous="old", hysteresis_ms=1000)
    assert choice is not None and choice.site == "new"


# -- session affinity ------------------------------------------------------------------------


def assign(ranking: Ranking, keys: list[str], **kwargs: Any) -> dict[str, str]:
    out = {}
    for key in keys:
        choice = pick(ranking, rng=random.Random(0), key=key, **kwargs)
        assert choice is not None
        out[key] = choice.site
    return out


KEYS = [f"session-{i}" for i in range(1000)]


def test_same_key_same_site_while_healthy_despite_load_changes() -> None:
    cands, rtts = equal_sites(4)
    first = assign(ranking_of(cands, rtts), KEYS[:50])
    rng = random.Random(9)
    for _ in range(20):
        loaded = [cand(c.site, in_flight=rng.randrange(8)) for c in cands]
        ranking = ranking_of(loaded, rtts)
        for key, site in first.items():
            choice = pick(ranking, rng=rng, key=key)
            assert choice is not None and choice.site == site and choice.mode is ChoiceMode.affinity


def test_removing_an_unrelated_site_moves_only_its_keys() -> None:
    cands, rtts = equal_sites(5)
    before = assign(ranking_of(cands, rtts), KEYS)
    assert set(Counter(before.values())) == set(rtts)  # every site holds some keys
    after = assign(ranking_of([c for c in cands if c.site != "s2"], rtts), KEYS)
    for key, site in before.items():
        if site != "s2":
            assert after[key] == site
        else:
            assert after[key] != "s2"


def test_adding_a_site_moves_keys_only_onto_it() -> None:
    cands, rtts = equal_sites(4)
    before = assign(ranking_of(cands, rtts), KEYS)
    after = assign(ranking_of([*cands, cand("new")], {**rtts, "new": 10}), KEYS)
    moved = [k for k in KEYS if after[k] != before[k]]
    assert moved and all(after[k] == "new" for k in moved)


def test_a_failed_site_sheds_its_keys_and_gets_them_back() -> None:
    cands, rtts = equal_sites(3)
    before = assign(ranking_of(cands, rtts), KEYS)
    down = [cand(c.site, healthy=c.site != "s1") for c in cands]
    during = assign(ranking_of(down, rtts), KEYS)
    assert "s1" not in during.values()
    assert all(during[k] == before[k] for k in KEYS if before[k] != "s1")
    assert assign(ranking_of(cands, rtts), KEYS) == before


def test_affinity_keeps_the_session_site_and_ignores_far_sites() -> None:
    cands, rtts = equal_sites(3)
    cands.append(cand("far"))
    rtts["far"] = 500.0  # beyond affinity_slack_ms of the best
    ranking = ranking_of(cands, rtts)
    mapping = assign(ranking, KEYS)
    assert "far" not in mapping.values()
    unslacked = assign(ranking, KEYS, affinity_slack_ms=None)
    assert "far" in unslacked.values()
    key = next(k for k, s in mapping.items() if s != "s0")
    choice = pick(ranking, rng=random.Random(0), key=key, previous="s0")
    assert choice is not None and (choice.site, choice.mode) == ("s0", ChoiceMode.sticky)
    assert choice.pool == ("s0", "s1", "s2")


# -- candidates from a registry snapshot -----------------------------------------------------


def test_candidates_from_snapshot() -> None:
    snapshot = Snapshot(
        revision=1,
        specs={"a": spec("a", "east", 31, 121), "b": spec("b", "west", 30, 104)},
        cordons={"a": Cordon(since=1.0, reason="maintenance")},
        services={
            ("llm", "a"): endpoint("a"),
            ("llm", "b"): endpoint("b"),
            ("llm", "gone"): endpoint("gone"),
            ("other", "a"): endpoint("a", service="other"),
        },
    )
    cands = candidates_from_snapshot(
        snapshot, "llm", error_rates={"a": 0.1}, ejected_until={"b": 5.0}, draining=["b"]
    )
    assert [(c.site, c.region, c.site_state) for c in cands] == [
        ("a", "east", SiteState.cordoned),
        ("b", "west", SiteState.down),  # no agent holds it
    ]
    assert (cands[0].error_rate, cands[1].ejected_until, cands[1].draining) == (0.1, 5.0, True)
    ranking = rank("llm", "city", cands, topo(a=5, b=5), Policy(), NOW)
    assert ranking.reasons() == {"b": Exclusion.unhealthy}
    assert ranking.ranked[0].score.penalty_ms == 100 + 10_000


def test_admit_full_ranks_full_sites_by_their_queue() -> None:
    # both sites full: excluded by default; admitted, the shorter queue scores better
    cands = [
        cand("long", max_concurrency=4, in_flight=4, queue=6),
        cand("short", max_concurrency=4, in_flight=4, queue=2),
        cand("down", max_concurrency=4, site_state=SiteState.down),
    ]
    rtts = {"long": 10.0, "short": 10.0, "down": 1.0}
    strict = ranking_of(cands, rtts)
    assert strict.ranked == () and strict.reasons()["short"] is Exclusion.full
    admitted = rank("llm", "city", cands, topo(**rtts), Policy(), NOW, admit_full=True)
    assert [s.site for s in admitted.ranked] == ["short", "long"]
    assert admitted.reasons() == {"down": Exclusion.unhealthy}  # health still applies
    # 100 ms x (1 + (4 + 2 + 1 - 4) / 4)
    assert admitted.ranked[0].score.service_ms == pytest.approx(175.0)


def test_service_time_is_pooled_per_model_unless_far_off() -> None:
    cands = [
        cand("lucky", latency_ms=100),
        cand("unlucky", latency_ms=164),  # the same model: noise, pooled
        cand("silent", latency_ms=None),  # no report yet: the pool too
        cand("slow", latency_ms=400),  # over 2x the median: its own figure
        cand("other", model="big", latency_ms=700),  # another model: its own pool
    ]
    rtts = dict.fromkeys(["lucky", "unlucky", "silent", "slow", "other"], 0.0)
    service = {s.site: s.score.service_ms for s in ranking_of(cands, rtts).ranked}
    assert service == {"lucky": 164, "unlucky": 164, "silent": 164, "slow": 400, "other": 700}
