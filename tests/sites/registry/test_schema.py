"""The registry's schema version (sites.model.schema, sites.registry.schema) on a real etcd:
written once by the first broker, raised by a newer one, read by agents; a cpn too old for the
registry's layout refuses to start, the broker and the agent processes with one line naming
both versions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from sites.emulation.etcd_server import EmbeddedEtcd, free_port
from sites.model import keys
from sites.model.schema import MIN_READER, SCHEMA_VERSION, Schema, SchemaTooNew
from sites.registry.client import Registry
from sites.registry.schema import ensure_schema
from tests.conftest import run_cpn
from tests.sites.agent.test_agent import join


async def _stored(registry: Registry) -> Schema | None:
    got = await registry.get_raw(keys.SCHEMA)
    return None if got is None else Schema.model_validate_json(got[0])


async def test_the_first_broker_writes_the_schema_once_and_a_newer_one_raises_it(
    registry: Registry,
) -> None:
    assert await _stored(registry) is None
    seen = await ensure_schema(registry, now=1.0, write=False)  # an agent writes nothing
    assert seen.version == SCHEMA_VERSION and await _stored(registry) is None
    first, second = await asyncio.gather(
        ensure_schema(registry, now=2.0, write=True), ensure_schema(registry, now=2.0, write=True)
    )
    assert first == second  # two brokers starting at once: one write, the same schema
    stored = await _stored(registry)
    assert stored is not None and (stored.version, stored.min_reader) == (
        SCHEMA_VERSION,
        MIN_READER,
    )
    revision = (await registry.get_raw(keys.SCHEMA) or (b"", 0))[1]
    assert await ensure_schema(registry, now=3.0, write=True) == stored  # as it is: no write
    assert (await registry.get_raw(keys.SCHEMA) or (b"", 0))[1] == revision

    # a broker of the next schema, which older cpns may still run beside, raises it
    newer = await ensure_schema(
        registry, now=4.0, write=True, version=SCHEMA_VERSION + 1, min_reader=SCHEMA_VERSION
    )
    assert (newer.version, newer.min_reader) == (SCHEMA_VERSION + 1, SCHEMA_VERSION)
    assert await ensure_schema(registry, now=5.0, write=True) == newer  # this cpn runs beside
    assert await ensure_schema(registry, now=5.0, write=False) == newer


async def test_a_cpn_too_old_for_the_registry_refuses_naming_both_versions(
    registry: Registry,
) -> None:
    ahead = Schema(version=SCHEMA_VERSION + 2, min_reader=SCHEMA_VERSION + 1, written_by="9.9")
    await registry.put_raw(keys.SCHEMA, ahead.model_dump_json().encode())
    for write in (True, False):
        with pytest.raises(SchemaTooNew) as refused:
            await ensure_schema(registry, now=1.0, write=write)
        message = str(refused.value)
        assert f"schema is {SCHEMA_VERSION + 2}, written by cpn 9.9" in message
        assert f"knows schema {SCHEMA_VERSION}" in message
    assert await _stored(registry) == ahead  # nothing written over it


@pytest.mark.e2e  # starts the broker and an agent
async def test_the_broker_and_an_agent_refuse_a_newer_registry_in_one_line(
    registry: Registry, site_file: Callable[..., Path], etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    file = site_file("schema-a")
    await join(registry, file)
    ahead = Schema(version=SCHEMA_VERSION + 1, min_reader=SCHEMA_VERSION + 1, written_by="9.9")
    await registry.put_raw(keys.SCHEMA, ahead.model_dump_json().encode())
    broker = run_cpn(
        "broker", "--etcd", etcd.url, "--listen", f"127.0.0.1:{free_port()}",
        "--state-dir", str(tmp_path / "broker"), timeout=90,
    )  # fmt: skip
    agent = run_cpn("agent", "--site", str(file), "--etcd", etcd.url, timeout=90)
    for done in (broker, agent):
        errors = [line for line in done.stderr.splitlines() if line.startswith("cpn: error")]
        assert done.returncode == 2, done.stderr[-2000:]
        assert len(errors) == 1 and "schema" in errors[0] and "9.9" in errors[0], errors
        assert "Traceback" not in done.stderr
