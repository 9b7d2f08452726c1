"""The broker's view through a re-list (broker.state.view_cache): half re-listed it says so, a
restore's marks are seen with the assignments, and the unfinished jobs a re-list no longer
finds are remembered as vanished."""

from __future__ import annotations

from broker.state.store import encode
from broker.state.view_cache import PREFIXES, ViewCache
from sites.model import keys
from sites.model.recovery import RestoreMark
from sites.registry.client import Registry
from tests.broker.leader.test_decisions import job


async def test_a_relist_is_half_done_until_its_last_prefix(registry: Registry) -> None:
    cache = ViewCache(registry=registry, on_change=lambda: None)
    record, _ = job("gone-abc123")
    mark = RestoreMark(generation="g", restored_at=0.0, snapshot_revision=1)
    cache._reset(keys.JOBS, [(keys.job(record.id), encode(record), 5)])
    assert record.id in cache.view().jobs
    for prefix in PREFIXES:
        kvs = []
        if prefix == keys.ASSIGNMENTS:
            kvs = [(keys.restore_mark("a"), mark.model_dump_json().encode(), 6)]
        cache._reset(prefix, kvs)
        assert cache.relisting is (prefix != PREFIXES[-1])
    assert cache.restore_marks == {"a"}
    assert cache.view().assignments == {}  # the mark is not an assignment
    assert record.id in cache.view().vanished  # the registry no longer has it
    cache._event(keys.ASSIGNMENTS, keys.restore_mark("a"), None, 7)
    assert cache.restore_marks == set()
