"""A run's data consequences, written with the job write that ends the run (a transactional
outbox at /cpn/v1/data-outbox/<job>/<attempt>): the outputs to register as dataset versions
(a succeeded run only) and the bytes it pulled from other sites, to bill. The leader's outbox
loop (broker.leader.data_outbox) carries each out idempotently and deletes it, so a broker
killed at any moment neither loses nor doubles either."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sites.model.data import Egress, OutputMade


class DataOutbox(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    job: str
    tenant: str
    attempt: int = Field(ge=1)
    site: str = Field(description="where the run ran: egress is billed into its region")
    succeeded: bool
    outputs: tuple[OutputMade, ...] = ()
    egress: tuple[Egress, ...] = ()
    at: float
