"""The executor a site file names: confined local processes by default, Slurm where the site
runs Slurm (sites.executors.local, sites.executors.slurm)."""

from __future__ import annotations

import logging

from sites.executors.base import (
    Executor,
    UnavailableExecutor,
    default_work_dir,
)
from sites.executors.confinement import Confiner
from sites.executors.local import LocalExecutor
from sites.executors.slurm import SlurmExecutor
from sites.executors.slurm_commands import SlurmCommands
from sites.kits.clock import Clock
from sites.model.catalog import DeviceCatalog
from sites.model.spec import ExecutorKind, SiteSpec

log = logging.getLogger(__name__)


def make_executor(spec: SiteSpec, *, catalog: DeviceCatalog, clock: Clock) -> Executor:
    """The executor spec.executor names; Slurm without its client commands fails every run.
    ConfigError when the site's confinement names an account this host cannot give."""
    work_dir = default_work_dir(spec)
    if spec.executor.kind is ExecutorKind.slurm:
        commands = SlurmCommands.from_settings(spec.executor.slurm_settings)
        if commands.missing():
            missing = ", ".join(commands.missing())
            log.error("site %s: slurm executor: %s not found", spec.id, missing)
            return UnavailableExecutor("slurm", work_dir, f"slurm executor: {missing} not found")
        return SlurmExecutor(
            work_dir=work_dir, spec=spec, catalog=catalog, clock=clock, commands=commands
        )
    confiner = Confiner(spec.executor.confinement, site=spec.id, work_dir=work_dir)
    return LocalExecutor(
        work_dir=work_dir, site=spec.id, catalog=catalog, clock=clock, confiner=confiner
    )
