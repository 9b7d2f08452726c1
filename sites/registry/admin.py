"""etcd's own users and roles, driven through the registry client: auth switched on once, the
broker's and each site's user and role granted (docs/security.md).
"""

from __future__ import annotations

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


async def grant_site(registry: Registry, spec: SiteSpec) -> str:
    """The site's own user and role, with `site_grants(spec)`; returns the user's name."""
    user = site_user(spec.id)
    await ensure_role(registry, user, site_grants(spec))
    await ensure_user(registry, user, user)
    return user


async def revoke_site(registry: Registry, site: str) -> None:
    """Remove a site's user and role (`cpn site leave` once the site is gone)."""
    user = site_user(site)
    await _quiet(registry, "UserDelete", rpc.AuthUserDeleteRequest(name=user), "not found")
    await _quiet(registry, "RoleDelete", rpc.AuthRoleDeleteRequest(role=user), "not found")
