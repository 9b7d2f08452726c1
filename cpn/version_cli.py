"""`cpn version`: the installed package's version, the registry schema it knows
(sites.model.schema), whether its hot path runs compiled, and where its shipped configs are
read from (an installed package's own copy, or a checkout's).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from importlib import metadata

__all__ = ["add_parsers", "cmd_version"]


def cmd_version(args: argparse.Namespace) -> int:
    from routing import native
    from sites.model.configs_home import PACKAGED, configs_home
    from sites.model.schema import MIN_READER, SCHEMA_VERSION

    native.install()
    try:
        version = metadata.version("cpn")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed: run from a checkout)"
    home = configs_home()
    info = {
        "version": version,
        "schema": SCHEMA_VERSION,
        "runs_beside_schema_from": MIN_READER,
        "hot_path": native.state(),
        "configs": str(home),
        "configs_from": "package" if home.name == PACKAGED else "checkout",
    }
    if args.output == "json":
        print(json.dumps(info, indent=1))
        return 0
    compiled = "compiled" if native.compiled() else f"pure Python ({native.state()})"
    print(
        f"cpn {version}; registry schema {SCHEMA_VERSION} (runs beside schema {MIN_READER} "
        f"and later); hot path {compiled}; configs from the {info['configs_from']}: {home}"
    )
    return 0


def add_parsers(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`cpn version`, added with cpn.cli's `add`."""
    p = add("version", help="the package's version, compiled or pure, where its configs are")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.set_defaults(func=cmd_version)
