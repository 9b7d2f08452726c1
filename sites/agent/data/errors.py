"""Errors of the site's data plane, each with the HTTP status its routes answer it with.

    SitesError
    └── DataError                       status 500 (a bug if it reaches a client)
        ├── BadInput (ValueError)       400 a path, sha256, digest or body that is malformed
        ├── Unauthorized                401 no credential, or one that is not good here
        ├── Forbidden                   403 a good credential that does not cover what is asked
        ├── NotHeld (LookupError)       404 no complete object, file or checkpoint here
        ├── Conflict                    409 what a commit names is missing or does not match
        ├── TooLarge                    413 a body over what the store may hold
        ├── StoreFull                   507 what the store holds leaves no room for it
        ├── StagingError                no source could serve what a staging needed (one line)
        └── PeerError                   another site's store failed a push (one line)

Each carries `field`: the input that was wrong (a path, 'sha256', 'seq'), or None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sites.model.errors import SitesError

if TYPE_CHECKING:
    from aiohttp import web


class DataError(SitesError):
    status = 500
    code = "internal"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class BadInput(DataError, ValueError):
    status = 400
    code = "invalid"


class Unauthorized(DataError):
    status = 401
    code = "unauthorized"


class Forbidden(DataError):
    status = 403
    code = "forbidden"


class NotHeld(DataError, LookupError):
    status = 404
    code = "not_found"


class Conflict(DataError):
    status = 409
    code = "conflict"


class TooLarge(DataError):
    status = 413
    code = "too_large"


class StoreFull(DataError):
    status = 507
    code = "store_full"


class StagingError(DataError):
    code = "staging_failed"


class PeerError(DataError):
    """Another site's store could not be reached, or refused a push (one line, naming it)."""

    code = "peer_failed"


async def json_list(request: web.Request, name: str, limit: int) -> list[Any]:
    """The list a route's JSON body holds under `name` ({"name": [...]}), at most `limit`
    long; BadInput naming `name` otherwise."""
    try:
        body = await request.json()
        items = body[name]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f'the body must be {{"{name}": [...]}}', name) from exc
    if not isinstance(items, list) or len(items) > limit:
        raise BadInput(f"{name} must be a list of at most {limit}", name)
    return items
