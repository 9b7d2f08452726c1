"""Exceptions raised by the routing package on purpose.

RoutingError
├── CandidateError (ValueError)      a candidate set that cannot be ranked: a site given twice,
│                                    an error_rate outside [0, 1]
├── InvalidParameter (ValueError)    a selection or routing parameter out of range; `field`
│                                    names it (near_best_ms, policy.scoring, ...)
└── ProxyError                       what the proxy's `pick` raises to turn a request away
    ├── UnknownRegion (LookupError)  -> 400 unknown_region, field X-Cpn-Client-Region
    └── UnknownService (LookupError) -> 404 unknown_service, field service

The built-in bases are kept so callers that caught ValueError or LookupError keep working.
Settings models (RoutingSettings, ScoringSettings, OutlierSettings) are pydantic models: bad
values there are pydantic ValidationErrors naming the field, not these.
"""

from __future__ import annotations

__all__ = [
    "CandidateError",
    "InvalidParameter",
    "ProxyError",
    "RoutingError",
    "UnknownRegion",
    "UnknownService",
]


class RoutingError(Exception):
    """Base of every error the routing package raises on purpose."""


class CandidateError(RoutingError, ValueError):
    """The candidates handed to rank cannot be ranked (the caller built them wrong)."""


class InvalidParameter(RoutingError, ValueError):
    """A parameter of a routing function is out of range; `field` names it."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class ProxyError(RoutingError):
    """Base of what the proxy's `pick` may raise to turn a request away with a 4xx."""


class UnknownRegion(ProxyError, LookupError):
    pass


class UnknownService(ProxyError, LookupError):
    pass
