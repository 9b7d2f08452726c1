"""etcd's own users and roles, driven through the registry client: auth switched on once, the
broker's and each site's user and role granted (docs/security.md).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from aetcd import rpc

from sites.model.errors import RegistryError
from sites.model.spec import SiteSpec
from sites.registry.client import Registry
from sites.registry.security import (
    BROKER_GRANTS,
    BROKER_USER,
    ROOT_USER,
    Grant,
    missing,
    permission,
    role_permissions,
    site_grants,
    site_user,
)


async def _quiet(registry: Registry, method: str, request: Any, *exists: str) -> None:
    """An Auth call whose "already exists" (or "already granted") answer is success."""
    try:
        await registry.auth(method, request)
    except RegistryError as exc:
        if not any(text in str(exc) for text in exists):
            raise


async def auth_enabled(registry: Registry) -> bool:
    reply = await registry.auth("AuthStatus", rpc.AuthStatusRequest())
    return bool(reply.enabled)


async def ensure_role(registry: Registry, role: str, grants: Sequence[Grant]) -> None:
    """Make `role` exist with exactly `grants` (a site whose services changed loses the old)."""
    await _quiet(registry, "RoleAdd", rpc.AuthRoleAddRequest(name=role), "already exists")
    reply = await registry.auth("RoleGet", rpc.AuthRoleGetRequest(role=role))
    add, revoke = missing(role_permissions(reply), grants)
    for grant in add:
        await registry.auth(
            "RoleGrantPermission",
            rpc.AuthRoleGrantPermissionRequest(name=role, perm=permission(grant)),
        )
    for grant in revoke:
        await registry.auth(
            "RoleRevokePermission",
            rpc.AuthRoleRevokePermissionRequest(
                role=role, key=grant.key.encode(), range_end=grant.range_end()
            ),
        )


async def ensure_user(registry: Registry, user: str, role: str) -> None:
    """A user with no password (it authenticates by its certificate's CN) holding `role`."""
    await _quiet(
        registry,
        "UserAdd",
        rpc.AuthUserAddRequest(name=user, options=rpc.UserAddOptions(no_password=True)),
        "already exists",
    )
    await _quiet(
        registry, "UserGrantRole", rpc.AuthUserGrantRoleRequest(user=user, role=role), "granted"
    )


async def bootstrap_auth(registry: Registry) -> bool:
    """Create root and the broker's user, then enable auth; True if it was enabled now.
    Connected as root already (a certificate with CN root), or to an etcd without auth yet."""
    await ensure_user(registry, ROOT_USER, "root")  # etcd's built-in role
    await ensure_role(registry, BROKER_USER, BROKER_GRANTS)
    await ensure_user(registry, BROKER_USER, BROKER_USER)
    if await auth_enabled(registry):
        return False
    await registry.auth("AuthEnable", rpc.AuthEnableRequest())
    return True


async def site_users(registry: Registry, site: str) -> list[str]:
    """The etcd users of `site`: `site-<site>`, and those that replaced it when its client
    certificate was revoked (`site-<site>.<random>`, `replace_site_user`); a site id has no
    dot, so no other site's user is among them."""
    reply = await registry.auth("UserList", rpc.AuthUserListRequest())
    base = site_user(site)
    return sorted(u for u in reply.users if u == base or u.startswith(base + "."))


async def grant_site(registry: Registry, spec: SiteSpec) -> str:
    """The site's own role, with `site_grants(spec)`, and its user (the one it has: a site
    whose certificate was revoked keeps its replaced user); returns the user's name."""
    role = site_user(spec.id)
    await ensure_role(registry, role, site_grants(spec))
    users = await site_users(registry, spec.id)
    user = users[-1] if users else role
    await ensure_user(registry, user, role)
    return user


async def replace_site_user(registry: Registry, site: str) -> tuple[str, list[str]]:
    """A new user for `site`, holding its role, for its reissued client certificate (a new
    CN); (the new user, the users it replaces). Delete those (`drop_site_users`) once the new
    certificate is in its credential file: etcd checks a request's user at each request, so the
    connections the revoked certificate has open are refused from then on, where its CRL is
    read at a handshake only."""
    role = site_user(site)
    old = await site_users(registry, site)
    user = f"{role}.{secrets.token_hex(4)}"
    await ensure_user(registry, user, role)
    return user, old


async def drop_site_users(registry: Registry, users: Sequence[str]) -> None:
    for user in users:
        await _quiet(registry, "UserDelete", rpc.AuthUserDeleteRequest(name=user), "not found")


async def revoke_site(registry: Registry, site: str) -> None:
    """Remove a site's users and role (`cpn site leave` once the site is gone)."""
    await drop_site_users(registry, await site_users(registry, site))
    role = site_user(site)
    await _quiet(registry, "RoleDelete", rpc.AuthRoleDeleteRequest(role=role), "not found")
