"""`cpn systemd install`: the agent's and the broker's systemd units, and the places they read
and write (docs/operations.md, "Running cpn as systemd services").

The units ship in the package (configs/systemd/, sites.model.configs_home) with ``@CPN@`` where
the cpn command goes; installing writes them with this installation's command, adds the
restart backoff of systemd 254 and later in a drop-in where the host has it, makes /etc/cpn
(configuration, and credentials/ for files of mode 0600), copies the shipped configs to
/etc/cpn/config once, and makes the ``cpn`` system account the broker runs as. ``--root DIR``
writes under DIR instead of / (a package build, a test) and makes no account.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sites.model.configs_home import configs_home

__all__ = [
    "BACKOFF_DROPIN",
    "UNITS",
    "Installed",
    "cpn_command",
    "install",
    "render",
    "systemd_version",
    "units_dir",
]

UNITS = ("cpn-agent@.service", "cpn-broker.service")
# the files of /etc/cpn made when missing: shipped name -> installed name
ENV_FILES = {
    "cpn.env": "cpn.env",
    "broker.env": "broker.env",
    "agent.env": "agent-SITE.env.example",
}
# RestartSteps= and RestartMaxDelaySec= came in systemd 254: 5 s doubling up to 2 minutes
BACKOFF_SINCE = 254
BACKOFF_DROPIN = "[Service]\nRestartSteps=5\nRestartMaxDelaySec=2min\n"
USER = "cpn"


def units_dir() -> Path:
    return configs_home() / "systemd"


def systemd_version() -> int | None:
    """The host's systemd version (`systemctl --version`'s first line), None without one."""
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return None
    try:
        out = subprocess.run(
            [systemctl, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.match(r"systemd (\d+)", out)
    return int(found.group(1)) if found else None


def cpn_command() -> str:
    """The cpn command of this installation: the one running, else the one on PATH."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "cpn" and os.access(argv0, os.X_OK):
        return str(argv0.resolve())
    found = shutil.which("cpn")
    if found is None:
        raise FileNotFoundError("no cpn command on PATH: pass --cpn PATH")
    return str(Path(found).resolve())


def render(name: str, *, cpn: str) -> str:
    """A shipped unit with its ``@CPN@`` set to ``cpn``."""
    return (units_dir() / name).read_text().replace("@CPN@", cpn)


@dataclass
class Installed:
    """What `install` wrote or made, in order, and what it left because it was there."""

    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    account: str | None = None


def install(*, root: Path, cpn: str, version: int | None, make_account: bool) -> Installed:
    """Write the units and /etc/cpn under ``root`` (see the module docstring); files an
    operator may have edited (the env files, /etc/cpn/config) are kept when present."""
    done = Installed()
    unit_dir = root / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True, exist_ok=True)
    for name in UNITS:
        target = unit_dir / name
        target.write_text(render(name, cpn=cpn))
        target.chmod(0o644)
        done.written.append(target)
        if version is not None and version >= BACKOFF_SINCE:
            dropin = unit_dir / f"{name}.d" / "backoff.conf"
            dropin.parent.mkdir(exist_ok=True)
            dropin.write_text(BACKOFF_DROPIN)
            done.written.append(dropin)
    etc = root / "etc" / "cpn"
    for sub, mode in (("", 0o755), ("sites", 0o755), ("credentials", 0o750)):
        path = etc / sub if sub else etc
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(mode)
    for shipped, installed in ENV_FILES.items():
        target = etc / installed
        if target.exists():
            done.kept.append(target)
            continue
        shutil.copyfile(units_dir() / shipped, target)
        target.chmod(0o644)
        done.written.append(target)
    config = etc / "config"
    if config.exists():
        done.kept.append(config)
    else:
        shutil.copytree(
            configs_home(), config, ignore=shutil.ignore_patterns("systemd", "state", "__pycache__")
        )
        done.written.append(config)
    if make_account:
        done.account = _account(etc / "credentials")
    return done


def _account(credentials: Path) -> str:
    """The `cpn` system account (useradd), and credentials/ readable by its group: the
    broker's files there are its own, mode 0600; an agent's are root's."""
    try:
        pwd.getpwnam(USER)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        subprocess.run(
            [useradd, "--system", "--user-group", "--home-dir", "/var/lib/cpn", "--no-create-home",
             "--shell", "/usr/sbin/nologin", "--comment", "cpn broker", USER],
            check=True, timeout=30,
        )  # fmt: skip
    shutil.chown(credentials, group=USER)
    return USER
