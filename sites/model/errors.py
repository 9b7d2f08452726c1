"""Exceptions raised by the sites package.

    SitesError
    ├── ConfigError (ValueError)        a site file or config is invalid; carries every Problem
    ├── RegistryError                   the federation registry (etcd) failed us
    │   ├── RegistryUnavailable         (ConnectionError) etcd cannot be reached or timed out
    │   ├── Conflict                    a guarded transaction lost a race (the key changed)
    │   ├── LeaseLost                   our lease expired or was revoked while still needed
    │   ├── PermissionDenied            (PermissionError) etcd refused the connected user's
    │   │                               roles (sites.registry.security)
    │   └── RevisionCompacted           a read or watch asked for a revision etcd has already
    │                                   compacted away; read again at the current revision
    ├── BackupError (ValueError)        a registry backup that cannot be read or used: missing,
    │                                   unfinished, or not what it says (sites.registry.backups)
    ├── PeerRevoked (aiohttp.ClientConnectionError)  a connection to a peer whose certificate
    │                                   a CRL loaded since revokes (sites.kits.revocation)
    ├── NotJoined (LookupError)         the site id has no spec in the registry
    ├── AgentConflict                   another live agent already holds the site
    ├── SchemaTooNew                    the registry's layout is newer than this cpn can run
    │                                   against (sites.model.schema)
    ├── EtcdStartError                  the embedded etcd did not start
    ├── SlurmStartError                 the local test/demo Slurm did not start
    │                                   (sites.emulation.slurm_cluster)
    ├── CatalogError (ValueError)       the device catalog (sites.model.catalog)
    │   ├── InvalidCatalog              a catalog file that cannot be read or is not valid
    │   ├── InvalidPartition            a site's partitions the hardware cannot hold (.field)
    │   └── UnknownDevice (KeyError)    a device model the catalog does not have
    ├── LatencyConfigError (ValueError) a latency matrix file is missing or malformed; names
    │                                   the file and line (sites.model.latency)
    ├── ExecutorError                   a run could not be started (sites.executors.local)
    │   └── SlurmError                  a Slurm client command failed
    │                                   (sites.executors.slurm_commands)
    ├── AccountError                    a tenant has no account at this site
    │                                   (sites.executors.accounts)
    ├── Refused                         the site refuses runs: no sandbox can be made here
    │                                   (sites.executors.confinement)
    ├── CgroupError                     a run's cgroup could not be made or limited
    │                                   (sites.executors.cgroups)
    ├── EgressError                     a run's user-mode network could not be set up
    │                                   (sites.executors.netns)
    ├── UnknownJob (LookupError)        a job with no run at this site (sites.agent.runs)
    ├── DoesNotFit                      an assignment asks for more than the site has free
    │                                   (sites.agent.fit)
    ├── DataError                       the site's data plane (sites.agent.data.errors); each
    │   │                               carries the HTTP status its /data routes answer
    │   ├── BadInput (ValueError)       a path, sha256, digest or body that is malformed: 400
    │   ├── Unauthorized                no grant or credential, or one that does not verify: 401
    │   ├── Forbidden                   a valid credential that may not do this: 403
    │   ├── NotHeld (LookupError)       no complete object, file or checkpoint here: 404
    │   ├── Conflict                    a commit names what is missing or does not match: 409
    │   ├── TooLarge                    a body over what the store may hold: 413
    │   ├── StoreFull                   the store has no room for it (a backup's copy): 507
    │   ├── StagingError                no source could serve what a staging needed
    │   └── PeerError                   another site's data store refused or was unreachable
    └── IllegalReplicaTransition        a managed replica asked to move between states it
                                        cannot (sites.agent.replicas)

The classes drawn with a module live beside the code that raises them, which callers import
anyway. etcd and gRPC errors are translated where they enter (sites.registry.connection and the
registry client's other parts) and chained.
"""

from __future__ import annotations

from dataclasses import dataclass


class SitesError(Exception):
    """Base of every error the sites package raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where (file, dotted field path) and why."""

    source: str
    field: str
    reason: str

    def __str__(self) -> str:
        where = f"{self.source}: {self.field}" if self.field else self.source
        return f"{where}: {self.reason}"


class ConfigError(SitesError, ValueError):
    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        first = str(self.problems[0]) if self.problems else "invalid configuration"
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        super().__init__(first + more)


class RegistryError(SitesError):
    pass


class RegistryUnavailable(RegistryError, ConnectionError):
    pass


class PermissionDenied(RegistryError, PermissionError):
    """etcd refused a request for the connected user's roles (sites.registry.security)."""


class Conflict(RegistryError):
    pass


class LeaseLost(RegistryError):
    pass


class RevisionCompacted(RegistryError):
    """etcd no longer has `revision` (compacted); the read or watch must start again."""

    def __init__(self, message: str, *, revision: int) -> None:
        self.revision = revision
        super().__init__(message)


class NotJoined(SitesError, LookupError):
    def __init__(self, site: str) -> None:
        self.site = site
        super().__init__(f"site {site!r} is not joined; run `cpn site join FILE` first")


class AgentConflict(SitesError):
    pass


class EtcdStartError(SitesError):
    pass
