"""The Slurm client commands as the agent runs them (sbatch, squeue, scontrol, scancel, sacct,
sinfo, sacctmgr): from the site's `executor.slurm.bin_dir` or PATH, with its SLURM_CONF, each
bounded in time; a command that cannot be run is a SlurmError, one that fails returns its code.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sites.executors.base import ExecutorError
from sites.model.spec import SlurmSettings

COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sacct", "sinfo")
COMMAND_TIMEOUT_S = 30.0
DEFAULT_CONF = "/etc/slurm/slurm.conf"  # where the client commands look without SLURM_CONF


class SlurmError(ExecutorError):
    """A Slurm client command failed or could not be run; the message has its stderr."""


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error(self) -> str:
        text = (self.stderr or self.stdout).strip()
        return text.splitlines()[-1] if text else f"exit status {self.returncode}"


class SlurmCommands:
    """Runs the Slurm client commands (from ``bin_dir`` or PATH, with ``SLURM_CONF``)."""

    def __init__(self, *, bin_dir: str | None = None, conf: str | None = None) -> None:
        self.bin_dir = bin_dir
        self.conf = conf

    @classmethod
    def from_settings(cls, settings: SlurmSettings) -> SlurmCommands:
        return cls(bin_dir=settings.bin_dir, conf=settings.conf)

    def path(self, name: str) -> str | None:
        if self.bin_dir:
            return shutil.which(name, path=self.bin_dir)
        return shutil.which(name)

    def missing(self, names: Sequence[str] = COMMANDS) -> list[str]:
        return [name for name in names if self.path(name) is None]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.conf:
            env["SLURM_CONF"] = self.conf
        return env

    async def run(
        self,
        name: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Completed:
        """Run one command (in ``env`` plus SLURM_CONF, default os.environ); SlurmError when it
        cannot be run or takes too long (not on rc)."""
        program = self.path(name)
        if program is None:
            raise SlurmError(f"{name} not found" + (f" in {self.bin_dir}" if self.bin_dir else ""))
        try:
            proc = await asyncio.create_subprocess_exec(
                program,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.env(env),
                cwd=cwd,
            )
        except OSError as exc:
            raise SlurmError(f"cannot run {name}: {exc.strerror or exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), COMMAND_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SlurmError(f"{name} did not answer within {COMMAND_TIMEOUT_S:.0f}s") from None
        code = proc.returncode if proc.returncode is not None else -1
        return Completed(code, out.decode(errors="replace"), err.decode(errors="replace"))
