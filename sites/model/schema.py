"""The registry's schema version: which layout of keys and records (sites.model.keys) the
registry holds, and which cpn may run against it.

    /cpn/v1/schema   Schema   the first broker to start on an empty registry; a broker of a
                              newer schema raises it once its migrations are done

`SCHEMA_VERSION` is the layout this cpn writes; `MIN_READER` the oldest layout a cpn must know
to run beside it (what a rolling upgrade may keep running). A cpn whose SCHEMA_VERSION is below
the registry's `min_reader` refuses to start, with one line naming both (`SchemaTooNew`): it
would misread what a newer cpn wrote. A registry older than this cpn is read as it is: the
broker's migrations (keys.MIGRATIONS, each resumable and recorded once done) bring it up, and
the schema is raised after them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sites.model.errors import SitesError

__all__ = ["MIN_READER", "SCHEMA_VERSION", "Schema", "SchemaTooNew", "check"]

# 1: the layout of 2026-12 (job index v2, replica keys, usage segments and rollups, datasets)
SCHEMA_VERSION = 1
MIN_READER = 1


class Schema(BaseModel):
    """What /cpn/v1/schema holds."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # a newer cpn may say more

    version: int = Field(ge=1, description="the layout the registry holds")
    min_reader: int = Field(ge=1, description="the oldest layout a cpn running on it must know")
    written_by: str = Field(default="", description="the cpn package version that wrote it")
    written_at: float = 0.0


class SchemaTooNew(SitesError):
    """The registry's layout is newer than this cpn can run against."""

    def __init__(self, stored: Schema, reads: int, package: str) -> None:
        self.stored = stored
        self.reads = reads
        by = f", written by cpn {stored.written_by}" if stored.written_by else ""
        super().__init__(
            f"the registry's schema is {stored.version}{by} and needs a cpn of schema "
            f"{stored.min_reader} or later; this cpn {package} knows schema {reads}: upgrade it"
        )


def check(stored: Schema, package: str, reads: int = SCHEMA_VERSION) -> None:
    """SchemaTooNew unless a cpn that knows schema `reads` may run on `stored`."""
    if stored.min_reader > reads:
        raise SchemaTooNew(stored, reads, package)
