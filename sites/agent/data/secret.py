"""The agent's data key: signs the grants its store accepts (sites.model.data.verify).

Made once, at random, and kept at `<store root>/.data-key` (0600), so a grant the broker minted
before the agent restarted is still good after (a transfer resumes once the source is back).
The agent publishes it in its AgentSecret, which only the broker and the site may read.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

KEY_FILE = ".data-key"
MIN_LENGTH = 32


def data_key(root: Path) -> str:
    """The key kept under `root`, made (atomically, 0600) when there is none or it is unusable."""
    path = root / KEY_FILE
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if len(key) >= MIN_LENGTH:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        return key
    root.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    tmp = root / f".{KEY_FILE}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key
