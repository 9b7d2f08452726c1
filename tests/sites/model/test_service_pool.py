"""Several replicas of a service at one site: each its own endpoint key, one pooled endpoint per
site for routing (sites.model.service_pool), the snapshot keeping both current
(sites.model.snapshot)."""

from __future__ import annotations

from typing import Any

import pytest

from sites.model import keys
from sites.model.service_pool import pool
from sites.model.snapshot import Snapshot
from sites.model.status import ServiceEndpoint


def replica(job: str, site: str = "a", **fields: Any) -> ServiceEndpoint:
    values: dict[str, Any] = {
        "service": "llm",
        "site": site,
        "model": "m",
        "url": f"http://{site}.example:{8000 + len(job)}/{job}",
        "max_concurrency": 8,
        "latency_ms": 100.0,
        "updated_at": 1000.0,
        "job": job,
    }
    values.update(fields)
    return ServiceEndpoint(**values)


def test_a_pool_sums_the_routable_replicas_slots_and_load() -> None:
    a = replica("j1", in_flight=3, queue=1, latency_ms=100.0, kv_cache_usage=0.2, signals_at=990.0)
    b = replica("j2", in_flight=5, queue=0, latency_ms=200.0, kv_cache_usage=0.6, signals_at=995.0)
    gone = replica("j0", in_flight=7, draining=True, healthy=False)
    got = pool([b, gone, a])
    assert (got.max_concurrency, got.in_flight, got.queue) == (16, 8, 1)
    assert got.latency_ms == pytest.approx(150.0)
    assert got.kv_cache_usage == pytest.approx(0.4)
    assert got.signals_at == 995.0  # the freshest: a stale replica is skipped by the choice
    assert (got.url, got.job, got.healthy, got.draining) == (a.url, None, True, False)


def test_one_replica_is_its_own_endpoint_and_none_routable_routes_nothing() -> None:
    only = replica("j1")
    assert pool([only]) is only
    both = pool([replica("j1", draining=True, healthy=False), replica("j2", healthy=False)])
    assert not both.healthy and not both.draining
    drained = pool([replica("j1", draining=True, healthy=False), replica("j2", draining=True)])
    assert not drained.healthy and drained.draining
    with pytest.raises(ValueError, match="at least one"):
        pool([])
    with pytest.raises(ValueError, match="one site"):
        pool([replica("j1"), replica("j2", site="b")])


def _put(snap: Snapshot, key: str, ep: ServiceEndpoint | None) -> None:
    snap.apply(key, None if ep is None else ep.model_dump_json().encode())


def test_the_snapshot_keeps_each_replica_and_the_sites_pool() -> None:
    snap = Snapshot(revision=1)
    one, two = replica("j1", in_flight=2), replica("j2", in_flight=4)
    _put(snap, keys.service_replica("llm", "a", "j1"), one)
    assert snap.services[("llm", "a")] == one
    _put(snap, keys.service_replica("llm", "a", "j2"), two)
    assert snap.services[("llm", "a")].in_flight == 6
    assert snap.services[("llm", "a")].max_concurrency == 16
    assert [ep.job for ep in snap.replica_endpoints("llm")] == ["j1", "j2"]
    # a site's own key (a declared service elsewhere) is read as before, alongside
    declared = replica("x", site="b").model_copy(update={"job": None})
    _put(snap, keys.service("llm", "b"), declared)
    assert snap.services[("llm", "b")] == declared
    assert [ep.job for ep in snap.replica_endpoints("llm")] == ["j1", "j2"]
    # an agent of before (its one replica under the site's key, with its job) still counts
    old = replica("j9", site="c")
    _put(snap, keys.service("llm", "c"), old)
    assert [ep.job for ep in snap.replica_endpoints("llm")] == ["j1", "j2", "j9"]
    _put(snap, keys.service_replica("llm", "a", "j1"), None)
    assert snap.services[("llm", "a")] == two
    _put(snap, keys.service_replica("llm", "a", "j2"), None)
    assert ("llm", "a") not in snap.services and ("llm", "a") not in snap.replicas
    snap.apply(keys.REPLICAS + "a/llm/j3/extra", b"{}")  # not an endpoint key: ignored
    assert ("llm", "a") not in snap.services
    snap.clear_services(keys.SERVICES)
    assert not (snap.services or snap.replicas or snap.site_endpoints)


def test_a_relist_of_one_prefix_forgets_only_its_endpoints() -> None:
    """The sites' own endpoints (keys.SERVICES) and the managed replicas' (keys.REPLICAS) are
    two prefixes, each re-listed on its own (broker.state.view): a reset of one keeps the other."""
    snap = Snapshot(revision=1)
    declared = replica("x").model_copy(update={"job": None})
    _put(snap, keys.service("llm", "a"), declared)
    _put(snap, keys.service_replica("llm", "a", "j1"), replica("j1", in_flight=2))
    _put(snap, keys.service_replica("llm", "b", "j2"), replica("j2", site="b"))
    snap.clear_services(keys.REPLICAS)
    assert snap.services == {("llm", "a"): declared} and not snap.replicas
    _put(snap, keys.service_replica("llm", "a", "j1"), replica("j1", in_flight=2))
    snap.clear_services(keys.SERVICES)
    assert snap.services[("llm", "a")].job == "j1" and not snap.site_endpoints
    assert snap.service_sites == {"llm": {"a"}}  # the index by service follows both
    assert [ep.job for ep in snap.replica_endpoints("llm")] == ["j1"]
    _put(snap, keys.service_replica("llm", "a", "j1"), None)
    assert snap.service_sites == {} and snap.replica_endpoints("llm") == []


def test_a_malformed_replica_value_is_skipped() -> None:
    snap = Snapshot(revision=1)
    snap.apply(keys.service_replica("llm", "a", "j1"), b"not json")
    assert ("llm", "a") not in snap.services
    assert keys.service_endpoint("llm", "a", None) == keys.service("llm", "a")
    assert keys.service_endpoint("llm", "a", "j1") == "/cpn/v1/replicas/a/llm/j1"
