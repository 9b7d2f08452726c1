"""The registry's schema version at a process's start (sites.model.schema): written by the
first broker on an empty registry, raised by a newer broker, checked by every broker and agent.
"""

from __future__ import annotations

import logging
from importlib import metadata

from pydantic import ValidationError

from sites.model import keys
from sites.model.schema import MIN_READER, SCHEMA_VERSION, Schema, check
from sites.registry.client import Registry
from sites.registry.transactions import Guard

__all__ = ["ensure_schema", "package_version"]

log = logging.getLogger(__name__)


def package_version() -> str:
    try:
        return metadata.version("cpn")
    except metadata.PackageNotFoundError:
        return "(not installed)"


async def ensure_schema(
    registry: Registry,
    *,
    now: float,
    write: bool,
    version: int = SCHEMA_VERSION,
    min_reader: int = MIN_READER,
) -> Schema:
    """The registry's schema, checked (SchemaTooNew); with `write` (a broker) written when the
    registry has none and raised when it is older than `version` (each in a transaction
    guarded on what was read: two brokers starting at once write it once)."""
    package = package_version()
    for _ in range(5):
        got = await registry.get_raw(keys.SCHEMA)
        stored: Schema | None = None
        if got is not None:
            try:
                stored = Schema.model_validate_json(got[0])
            except ValidationError:
                log.warning("the registry's schema record is unreadable; taking it as absent")
        if stored is not None:
            check(stored, package, version)
            if not write or stored.version >= version:
                return stored
        if not write:
            # an agent on a registry no broker has started on yet: what it would write
            return Schema(version=version, min_reader=min_reader, written_by=package)
        new = Schema(
            version=version,
            min_reader=max(min_reader, stored.min_reader if stored is not None else 0),
            written_by=package,
            written_at=now,
        )
        guard = Guard(keys.SCHEMA, mod_revision=got[1] if got is not None else 0)
        if await registry.commit(
            guards=[guard], puts={keys.SCHEMA: new.model_dump_json().encode()}
        ):
            if stored is not None:
                log.info("the registry's schema raised from %d to %d", stored.version, version)
            return new
    raise RuntimeError("the registry's schema kept changing while it was written")
