"""Inference tokens: what one request used, what it costs, and how a day of them is stored.

The gateway (broker.api.openai) settles every request it proxied with a `TokenUse`: the
`usage` the model server reported (a JSON body's, or a stream's last chunk), or, for a stream
cut before its usage chunk, the tokens the gateway counted that reached the client
(`counted=True`). The broker's token ledger (broker.state.token_ledger) sums them per
(tenant, model, site, client region) into one `TokenDay` per (UTC day, tenant, broker
replica) at /cpn/v1/usage/tokens/<day>/<tenant>/<writer> (sites.model.keys.usage_tokens).

Pricing (`cost_usd`): the site's `prices.usd_per_million_tokens` for the served model
(sites.model.spec.TokenPrice; '*' for any model not named; neither: no cost), prompt tokens
at `input` less the cached ones, which are at `cached_input` (absent: `input`), completion
tokens at `output`. The price is the one in force when the request ended (the site's price
history, sites.model.status.PriceHistory, as for jobs).

Pure: no I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from sites.model.spec import TokenPrice

__all__ = [
    "TokenDay",
    "TokenRow",
    "TokenUse",
    "cost_usd",
    "row_key",
    "split_row_key",
    "token_day",
]

_MILLION = 1_000_000.0


class TokenUse(NamedTuple):
    """One proxied inference request's tokens, as the gateway settles it (a named tuple: made
    twice per request on the gateway's path, where a frozen dataclass's 13 fields cost 2 us)."""

    request_id: str  # the X-Request-Id the client saw: a settlement's identity
    tenant: str
    token_id: str | None  # the API token it came with (per-token limits); None: auth is off
    model: str  # the served model (the endpoint's model name), what prices are keyed by
    requested: str  # the `model` the client sent: a model, a service or an alias
    service: str  # the service that served it
    site: str
    client_region: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the server took from its prefix cache (<= prompt)
    at: float  # unix s the request ended
    counted: bool = False  # True: the server reported no usage; the gateway counted the tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def cost_usd(use: TokenUse, price: TokenPrice | None) -> float:
    """What `use` costs at `price` (None: free); see the module docstring."""
    if price is None:
        return 0.0
    cached = min(max(use.cached_tokens, 0), use.prompt_tokens)
    cached_rate = price.input if price.cached_input is None else price.cached_input
    return (
        (use.prompt_tokens - cached) * price.input
        + cached * cached_rate
        + use.completion_tokens * price.output
    ) / _MILLION


_DAYS: dict[int, str] = {}


def token_day(at: float) -> str:
    """The UTC date (YYYY-MM-DD) a request ending at unix `at` is billed on (the last few days'
    names kept: a flush asks once per request)."""
    number = int(at // 86400)
    day = _DAYS.get(number)
    if day is None:
        if len(_DAYS) > 64:
            _DAYS.clear()
        day = _DAYS[number] = datetime.fromtimestamp(number * 86400, UTC).strftime("%Y-%m-%d")
    return day


def row_key(model: str, site: str, client_region: str) -> str:
    """A TokenDay row's key: 'model|site|client region' (none of them holds '|': a site and a
    region are DNS labels; a model name with '|' is refused where services are declared)."""
    return f"{model}|{site}|{client_region}"


def split_row_key(key: str) -> tuple[str, str, str]:
    """row_key's parts: (model, site, client region)."""
    model, site, region = key.rsplit("|", 2)
    return model, site, region


class TokenRow(BaseModel):
    """Sums over requests of one (model, site, client region)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    requests: int = Field(default=0, ge=0)
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    counted_requests: int = Field(
        default=0, ge=0, description="requests whose tokens the gateway counted (no usage came)"
    )
    usd: float = Field(default=0.0, ge=0)

    def add(self, use: TokenUse, usd: float) -> None:
        self.requests += 1
        self.prompt_tokens += use.prompt_tokens
        self.completion_tokens += use.completion_tokens
        self.cached_tokens += use.cached_tokens
        self.counted_requests += int(use.counted)
        self.usd += usd


class TokenDay(BaseModel):
    """/cpn/v1/usage/tokens/<day>/<tenant>/<writer>: one broker replica's sums for one tenant
    and day. `seq` is the last flush of that replica applied to it: a flush carries its
    number, and one at or below `seq` was applied already (a retried settlement adds
    nothing)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    day: str
    tenant: str
    writer: str
    seq: int = Field(default=0, ge=0)
    rows: dict[str, TokenRow] = Field(default_factory=dict, description="row_key -> sums")
