"""A Slurm site's file against its cluster, at the agent's start: a controller answers, the
partition, the accounts and QOS the site file names exist, and each tenant's Unix user is
associated with its Slurm account (else sbatch refuses its jobs); and how the cluster confines a
job (its TaskPlugin). A problem names its field (`cpn agent` exits 2).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

from sites.executors.accounts import Account
from sites.executors.slurm_batch import ACCOUNTS_FIELD
from sites.executors.slurm_commands import DEFAULT_CONF, SlurmCommands
from sites.model.errors import Problem
from sites.model.spec import SlurmSettings

log = logging.getLogger(__name__)


async def unreachable(commands: SlurmCommands) -> str | None:
    """Why no Slurm controller answers here (the client commands installed, no cluster
    configured or slurmctld down), None when one does. A missing slurm.conf is told at
    once: the commands would retry reading it for a minute each."""
    conf = commands.env().get("SLURM_CONF") or DEFAULT_CONF
    if not Path(conf).is_file():
        return f"slurm executor: no Slurm configuration at {conf}"
    got = await commands.run("sinfo", "-h", "-o", "%R")
    if got.returncode == 0:
        return None
    return f"slurm executor: no Slurm controller answers ({got.error.strip() or 'sinfo failed'})"


async def problems(
    commands: SlurmCommands,
    *,
    source: str,
    site: str,
    partition: str | None,
    settings: SlurmSettings,
    named: Mapping[str, Account],
    root: bool,
) -> list[Problem]:
    """What of the site file the cluster does not have: the partition, an account or a QOS
    (when sacctmgr can be asked), a named user's association with its tenant's account."""
    found: list[Problem] = []
    if partition:
        got = await commands.run("scontrol", "show", "partition", "-o", partition)
        if got.returncode != 0:
            listing = await commands.run("sinfo", "-h", "-o", "%R")
            have = ", ".join(sorted(set(listing.stdout.split()))) or "none"
            found.append(
                Problem(
                    source,
                    "executor.partition",
                    f"Slurm has no partition {partition!r} (it has: {have})",
                )
            )
    wanted = dict(settings.accounts)
    if settings.default_account is not None:
        wanted["*"] = settings.default_account
    if wanted and commands.path("sacctmgr") is not None:
        accounts = await _names(commands, site, "account", "Account")
        qos = await _names(commands, site, "qos", "Name")
        for tenant, mapping in sorted(wanted.items()):
            where = (
                "executor.slurm.default_account"
                if tenant == "*"
                else f"executor.slurm.accounts.{tenant}"
            )
            if accounts is not None and mapping.account.lower() not in accounts:
                found.append(
                    Problem(
                        source,
                        f"{where}.account",
                        f"Slurm has no account {mapping.account!r} "
                        f"(it has: {', '.join(sorted(accounts)) or 'none'})",
                    )
                )
            if qos is not None and mapping.qos and mapping.qos.lower() not in qos:
                found.append(
                    Problem(
                        source,
                        f"{where}.qos",
                        f"Slurm has no QOS {mapping.qos!r} "
                        f"(it has: {', '.join(sorted(qos)) or 'none'})",
                    )
                )
    found += await _user_problems(
        commands, source=source, site=site, settings=settings, named=named, root=root
    )
    return found


async def _user_problems(
    commands: SlurmCommands,
    *,
    source: str,
    site: str,
    settings: SlurmSettings,
    named: Mapping[str, Account],
    root: bool,
) -> list[Problem]:
    """Each named user must hold an association with its tenant's Slurm account, or sbatch
    refuses its jobs; tenants with an account and no user are told once, in the log."""
    unnamed = sorted(set(settings.accounts) - set(named))
    if unnamed and root:
        log.warning(
            "site %s: tenants with a Slurm account but no Unix user (%s.tenants), whose jobs "
            "are refused: %s", site, ACCOUNTS_FIELD, ", ".join(unnamed),
        )  # fmt: skip
    if not named or commands.path("sacctmgr") is None:
        return []
    got = await commands.run("sacctmgr", "-n", "-P", "show", "association", "format=User,Account")
    if got.returncode != 0:
        log.warning("site %s: cannot list Slurm associations: %s", site, got.error)
        return []
    pairs = {
        (user, account.lower())
        for user, _, account in (line.partition("|") for line in got.stdout.splitlines())
    }
    found = []
    for tenant, user in sorted(named.items()):
        mapping = settings.account_for(tenant)
        if mapping is not None and (user.name, mapping.account.lower()) not in pairs:
            found.append(
                Problem(
                    source,
                    f"{ACCOUNTS_FIELD}.tenants.{tenant}",
                    f"Slurm user {user.name!r} has no association with account "
                    f"{mapping.account!r} (sacctmgr add user {user.name} "
                    f"account={mapping.account})",
                )
            )
    return found


async def task_limits(commands: SlurmCommands) -> str | None:
    """What limits the cluster puts on a job, from its TaskPlugin (scontrol show config)."""
    got = await commands.run("scontrol", "show", "config")
    if got.returncode != 0:
        return None
    found = re.search(r"^TaskPlugin\s*=\s*(\S+)", got.stdout, re.MULTILINE)
    if found is None:
        return None
    plugin = found.group(1)
    if "task/cgroup" in plugin:
        return f"limits by Slurm's {plugin} (CPUs, memory, devices)"
    return f"no limits on the nodes (TaskPlugin={plugin})"


async def _names(commands: SlurmCommands, site: str, entity: str, column: str) -> set[str] | None:
    """Names sacctmgr lists (lower case); None when accounting cannot be asked."""
    got = await commands.run("sacctmgr", "-n", "-P", "show", entity, f"format={column}")
    if got.returncode != 0:
        log.warning("site %s: cannot list Slurm %s: %s", site, entity, got.error)
        return None
    return {line.strip().lower() for line in got.stdout.splitlines() if line.strip()}
