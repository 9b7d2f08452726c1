"""Where the configs cpn ships are: the device catalog, the demo federation's sites, regions,
clients, tenants, scenarios and traces.

In a checkout they are the repository's ``configs/``. An installed package has its own copy,
``sites/_configs`` (the build puts it there: setup.py), so that `cpn up`, `cpn agent` and the
rest read nothing from a checkout. ``$CPN_CONFIG_DIR`` overrides both (sites.model.config).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PACKAGED", "configs_home"]

PACKAGED = "_configs"  # under the sites package, in an installed one


def configs_home() -> Path:
    """The installed copy when there is one, else the repository's configs/."""
    sites = Path(__file__).resolve().parents[1]
    installed = sites / PACKAGED
    if installed.is_dir():
        return installed
    return sites.parent / "configs"
