"""The store on disk: LRU eviction with pins and holds, torn objects and checkpoints swept and
never used, the index and the data key surviving a restart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sites.agent.data.errors import Conflict
from sites.agent.data.secret import data_key
from sites.agent.data.store import DataStore
from tests.sites.agent.data.conftest import manifest_of, put_blobs


def test_lru_eviction_keeps_pinned_and_in_use_objects(tmp_path: Path) -> None:
    clock = iter(range(1000))
    store = DataStore(tmp_path / "s", 10_000, clock=lambda: float(next(clock)))
    old_pinned = put_blobs(store, {"a": b"1" * 3000})
    old_in_use = put_blobs(store, {"b": b"2" * 3000})
    oldest_free = put_blobs(store, {"c": b"3" * 3000})
    shared = put_blobs(store, {"d": b"4" * 3000, "c-again": b"3" * 3000})  # shares c's blob
    store.pin(old_pinned.digest)
    store.acquire(old_in_use.digest, "job:j1")
    store.tree(oldest_free.digest)  # used after `shared`: `shared` is the least recent now
    assert store.bytes_held() == 12_000

    evicted = store.evict_to(9_000)
    assert evicted == [shared.digest]  # c's blob stays: oldest_free uses it
    assert store.bytes_held() == 9_000 and store.has_blob(oldest_free.files[0].sha256)
    assert not (store.objects / shared.digest).exists()
    assert not (store.manifests / f"{shared.digest}.json").exists()

    assert store.evict_to(0) == [oldest_free.digest]  # the pinned and the held stay
    assert set(store.digests()) == {old_pinned.digest, old_in_use.digest}
    store.release("job:j1")
    store.unpin(old_pinned.digest)
    assert sorted(store.evict_to(0)) == sorted([old_pinned.digest, old_in_use.digest])
    assert store.bytes_held() == 0 and not list(store.blobs.iterdir())


def test_drop_waits_for_the_last_user(tmp_path: Path) -> None:
    store = DataStore(tmp_path / "s", 10_000)
    m = put_blobs(store, {"a": b"x" * 10})
    store.acquire(m.digest, "job:j1")
    assert store.drop(m.digest) is False and store.has(m.digest)
    assert store.release("job:j1") == [m.digest]
    assert not store.has(m.digest)


def test_index_pins_and_key_survive_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = DataStore(root, 10_000)
    m = put_blobs(store, {"a": b"x" * 10})
    store.pin(m.digest)
    key = data_key(root)
    assert (root / ".data-key").stat().st_mode & 0o777 == 0o600
    again = DataStore(root, 10_000)
    assert again.entry(m.digest).pinned and again.records()[m.digest].pinned
    assert data_key(root) == key


def test_torn_object_is_swept_and_never_served(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = DataStore(root, 10_000)
    m = put_blobs(store, {"a": b"x" * 10, "d/b": b"y" * 5})
    (store.manifests / f"{m.digest}.json").unlink()  # killed before the manifest was written
    (store.partial / "0123.tmp").write_bytes(b"junk")
    again = DataStore(root, 10_000)
    assert not again.has(m.digest) and not (again.objects / m.digest).exists()
    assert not (again.partial / "0123.tmp").exists()
    again.commit(m)  # its blobs are still there: made complete again
    assert (again.tree(m.digest) / "d/b").read_bytes() == b"y" * 5


def test_commit_names_the_missing_file(tmp_path: Path) -> None:
    store = DataStore(tmp_path / "s", 10_000)
    with pytest.raises(Conflict) as caught:
        store.commit(manifest_of({"x/never.bin": b"z"}))
    assert caught.value.field == "x/never.bin"


def test_torn_checkpoint_is_never_used(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = DataStore(root, 10_000)
    first = put_blobs(store, {"w": b"1" * 10, "step": b"1"})
    mark = store.put_checkpoint("acme", "job-1", 1, first, at=1.0, step=1, site="s")
    # the next checkpoint's object is complete, but the agent was killed before its entry
    # (written last) was renamed into place
    second = put_blobs(store, {"w": b"2" * 10, "step": b"2"})
    job_dir = store.checkpoints / "acme" / "job-1"
    (job_dir / ".0000000002.json.dead.tmp").write_text(mark.model_dump_json())
    again = DataStore(root, 10_000)
    assert again.latest("acme", "job-1") == mark
    assert [p.name for p in job_dir.iterdir()] == ["0000000001.json"]
    # a checkpoint entry whose object is gone (never complete) is not used either
    os.unlink(again.manifests / f"{first.digest}.json")
    third = DataStore(root, 10_000)
    assert third.latest("acme", "job-1") is None
    assert third.has(second.digest)


def test_checkpoints_keep_the_newest_three(tmp_path: Path) -> None:
    store = DataStore(tmp_path / "s", 100_000)
    digests = []
    for seq in range(1, 6):
        files = {"w": str(seq).encode() * 10}
        m = manifest_of(files)
        tmp = store.temp()
        tmp.write_bytes(files["w"])
        store.adopt(m.files[0].sha256, tmp)  # pushed: a blob, then the checkpoint
        store.put_checkpoint("acme", "job-1", seq, m, at=float(seq), step=seq * 10, site="s")
        digests.append(m.digest)
    assert [m.seq for m in store.marks("acme", "job-1")] == [3, 4, 5]
    assert store.latest("acme", "job-1").step == 50  # type: ignore[union-attr]
    assert not store.has(digests[0]) and store.has(digests[2])
    # kept checkpoints are never evicted by the cache
    assert store.evict_to(0) == []


def test_a_finished_jobs_checkpoints_expire_a_live_ones_stay(tmp_path: Path) -> None:
    now = [1_000_000.0]
    store = DataStore(tmp_path / "s", 100_000, clock=lambda: now[0])

    def checkpoint(job: str, seq: int, body: bytes) -> str:
        m = manifest_of({"w": body})
        tmp = store.temp()
        tmp.write_bytes(body)
        store.adopt(m.files[0].sha256, tmp)
        store.put_checkpoint("acme", job, seq, m, at=now[0], step=seq, site="s")
        return m.digest

    old = checkpoint("done-1", 1, b"old" * 10)
    shared = checkpoint("done-1", 2, b"both" * 10)
    live = checkpoint("live-1", 1, b"both" * 10)  # the same bytes: one object, two jobs
    assert shared == live
    entries = store.checkpoints / "acme" / "done-1"
    day = 86400.0
    for e in entries.glob("*.json"):  # done-1's last checkpoint was 15 days ago
        os.utime(e, (now[0] - 15 * day, now[0] - 15 * day))
    assert store.expire_checkpoints(max_age_s=14 * day) == ["acme/done-1"]
    assert store.marks("acme", "done-1") == [] and not entries.exists()
    assert not store.has(old)  # its own object went
    assert store.has(live) and store.latest("acme", "live-1") is not None  # live-1's stays
    assert store.expire_checkpoints(max_age_s=14 * day) == []
