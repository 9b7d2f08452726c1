"""Where a running `cpn up` records itself, so `cpn sites` finds its etcd without flags."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sites.kits.private import write_private as write_private  # the CLI's config file uses it


def state_dir() -> Path:
    env = os.environ.get("CPN_STATE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "cpn"


def up_state_path() -> Path:
    return state_dir() / "up.json"


def write_up_state(state: dict[str, Any]) -> None:
    write_private(up_state_path(), json.dumps(state, indent=2))


def read_up_state() -> dict[str, Any] | None:
    """The state of a `cpn up` that is still running, else None."""
    try:
        state = json.loads(up_state_path().read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state if isinstance(state, dict) else None


def clear_up_state(pid: int) -> None:
    path = up_state_path()
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass
