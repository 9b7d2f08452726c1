"""Where a running `cpn up` records itself, so `cpn sites` finds its etcd without flags."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def state_dir() -> Path:
    env = os.environ.get("CPN_STATE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "cpn"


def up_state_path() -> Path:
    return state_dir() / "up.json"


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by its owner only (it holds a token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(tmp, 0o600)  # a leftover tmp file keeps its old mode through O_CREAT
    tmp.replace(path)


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
