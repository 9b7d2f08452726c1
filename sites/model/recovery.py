"""A restore of the registry from a backup, and what became of the runs it did not know.

`cpn restore` writes a `Recovery` at /cpn/v1/recovery (phase `collecting`) and a `RestoreMark`
among each site's assignments, into the restored database before any member starts. An agent
that sees its site's mark holds its runs as they are (none is stopped for lack of an
assignment, none started), reports every run it knows again with its assignment, and says so
in its status (`SiteStatus.restored`). The leader broker holds scheduling while it collects,
then decides each run's fate (broker.leader.recovery): adopted, recovered, stopped, or the job
listed as lost, with why; it writes them here (phase `done`) and removes the marks.
docs/backup.md has the long form.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RestoreMark(_Frozen):
    generation: str = Field(description="this restore's id")
    restored_at: float = Field(description="unix s, when `cpn restore` rebuilt the registry")
    snapshot_revision: int
    snapshot_taken_at: float | None = Field(
        default=None, description="unix s; agents report again the runs that ended after it"
    )


class Phase(enum.StrEnum):
    collecting = "collecting"  # the agents report what they know; scheduling is held
    done = "done"


class Fate(enum.StrEnum):
    adopted = "adopted"  # a run of a job the registry knew, newer than what it knew: taken on
    recovered = "recovered"  # a job the registry did not know, rebuilt from its run
    billed = "billed"  # an ended run whose usage the ledger lacked: billed
    stopped = "stopped"  # a run that cannot be taken on: stopped
    lost = "lost"  # a job whose fate is unknown: the operator decides (listed by `cpn recovery`)


class RecoveredJob(_Frozen):
    job: str
    fate: Fate
    reason: str
    site: str | None = None
    tenant: str | None = None
    attempt: int | None = None


MAX_LISTED = 1000  # settled jobs other than the lost listed in the record (an etcd value)


class Recovery(_Frozen):
    generation: str
    snapshot: str = Field(description="the backup's file name")
    snapshot_revision: int
    snapshot_taken_at: float | None = Field(default=None, description="unix s, if known")
    restored_at: float
    collect_s: float = Field(
        gt=0, description="how long the leader waits for the agents of sites that do not report"
    )
    sites: tuple[str, ...] = Field(description="the sites the restored registry knows")
    phase: Phase = Phase.collecting
    opened_at: float | None = Field(default=None, description="when a leader first saw it")
    closed_at: float | None = None
    reported: tuple[str, ...] = Field(default=(), description="sites whose agents reported all")
    jobs: tuple[RecoveredJob, ...] = Field(
        default=(),
        description=f"each settled job: every lost one, at most {MAX_LISTED} others (the audit "
        "log has them all)",
    )
    counts: dict[str, int] = Field(default_factory=dict, description="jobs settled, per fate")

    def mark(self) -> RestoreMark:
        return RestoreMark(
            generation=self.generation,
            restored_at=self.restored_at,
            snapshot_revision=self.snapshot_revision,
            snapshot_taken_at=self.snapshot_taken_at,
        )

    def fated(self, fate: Fate) -> list[RecoveredJob]:
        return [j for j in self.jobs if j.fate is fate]

    def settled(self, jobs: list[RecoveredJob], *, closed_at: float) -> Recovery:
        """The record once done: its counts, the lost jobs all, the others up to MAX_LISTED."""
        counts = {f.value: sum(1 for j in jobs if j.fate is f) for f in Fate}
        lost = [j for j in jobs if j.fate is Fate.lost]
        others = [j for j in jobs if j.fate is not Fate.lost][:MAX_LISTED]
        return self.model_copy(
            update={
                "phase": Phase.done,
                "closed_at": closed_at,
                "jobs": (*lost, *others),
                "counts": {k: n for k, n in counts.items() if n},
            }
        )
