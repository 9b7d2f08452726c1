"""The gateway's hot path, compiled: which modules mypyc builds, and whether they are loaded.

What a proxied request runs (the inference lane, the proxy, the upstream client, the prefix
key, the rate limiter, and the routing decision: candidates, the ranked types, selection,
choice, policy) is plain, fully typed Python. setup.py compiles it with mypyc into C extension
modules beside the sources (`make` runs `setup.py build_ext --inplace`): the same code, with
less of the broker's CPU per proxied request (bench/JOURNAL.md, 2026-12-06, "the compiled hot
path").

Python loads an extension module before the source of the same name. An extension built from an
older source would run code that is no longer in the tree, so the build writes the digest of
each source it compiled (BUILT, beside this file), and `install()` (called by
routing/__init__.py before any of them is imported) checks them, and when

- any compiled module's source differs from what was compiled (edited since the build), or
  an extension is missing,
- or the environment says CPN_PURE_PYTHON=1 (to profile line by line with py-spy, or to
  rule the compiled code out),

it has all of them loaded from source, and says why once. All or none: the compiled modules
call each other natively, so a mix would run two copies of the same classes.

This module imports the standard library only: setup.py reads MODULES from it before anything
is installed.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["BUILT", "GROUP", "MODULES", "PURE_ENV", "compiled", "digests", "install", "state"]

log = logging.getLogger(__name__)

# Modules (dotted, as imported) that setup.py compiles, as one group (one shared library, in
# which they call each other natively). A module here must keep to what mypyc compiles: no
# pydantic model (routing.decision.settings holds the policy's), no subclass of a class from a
# C library other than the builtins' exceptions (routing.gateway.lane_site holds the lane's
# aiohttp site), no import cycle within the group.
MODULES: tuple[str, ...] = (
    "routing.gateway.lane",
    "routing.gateway.proxy",
    "routing.gateway.upstream",
    "routing.gateway.prefix",
    "routing.gateway.ratelimit",
    "routing.gateway.openai",
    "routing.gateway.tally",
    "routing.decision.selection",
    "routing.decision.policy",
    "routing.decision.candidates",
    "routing.decision.ranking",
    "routing.decision.choice",
)
# mypyc's group: the modules' code is in one shared library, GROUP + "__mypyc", in this
# package (a top-level one would be found only from the repository's root)
GROUP = "routing.hotpath"
PURE_ENV = "CPN_PURE_PYTHON"
BUILT = "native-build.json"  # {module: sha256 of the source compiled}, written by setup.py
_ROOT = Path(__file__).resolve().parent.parent

_state = "not checked"


def _source(name: str, root: Path = _ROOT) -> Path:
    return root.joinpath(*name.split(".")).with_suffix(".py")


def _extension(name: str, root: Path = _ROOT) -> Path | None:
    source = _source(name, root)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = source.with_suffix(suffix)
        if path.exists():
            return path
    return None


def digests(root: Path = _ROOT) -> dict[str, str]:
    """The sha256 of each compiled module's source under `root` (what setup.py writes to BUILT)."""
    return {name: hashlib.sha256(_source(name, root).read_bytes()).hexdigest() for name in MODULES}


def _check(root: Path = _ROOT) -> str:
    """'compiled', or why the sources are loaded: 'not built', 'stale: ...', 'CPN_PURE_PYTHON'."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return PURE_ENV
    built = {name: _extension(name, root) for name in MODULES}
    if not any(built.values()):
        return "not built"
    try:
        compiled_from = json.loads((root / "routing" / BUILT).read_text())
    except (OSError, ValueError):
        compiled_from = {}
    missing = [f"{name} not built" for name, path in built.items() if path is None]
    if _extension(GROUP + "__mypyc", root) is None:
        missing.append(f"{GROUP}__mypyc (their shared library) not built")
    now = digests(root)
    edited = [
        f"{name} edited since the build"
        for name, path in built.items()
        if path is not None and compiled_from.get(name) != now[name]
    ]
    return "stale: " + ", ".join(missing + edited) if missing or edited else "compiled"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules' sources, ahead of the extensions beside them."""

    def __init__(self, root: Path = _ROOT) -> None:
        self.root = root

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,  # noqa: ARG002
        target: ModuleType | None = None,  # noqa: ARG002
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, _source(fullname, self.root))


def install() -> None:
    """Decide, once per process, where the compiled modules load from (module docstring)."""
    global _state
    if _state != "not checked":
        return
    _state = _check()
    if _state == "compiled" or _state == "not built":
        return
    sys.meta_path.insert(0, _SourceFinder())
    if _state.startswith("stale"):
        log.warning(
            "routing: the compiled hot path is %s; running its Python sources "
            "(rebuild: make native)",
            _state,
        )


def state() -> str:
    """'compiled', 'not built', 'CPN_PURE_PYTHON', or 'stale: ...' (what install() found)."""
    return _state


def compiled() -> bool:
    """Whether the hot path runs compiled in this process."""
    return _state == "compiled"
