"""The gateway's hot path, compiled: which modules mypyc builds, and whether they are loaded.

The inference lane, the proxy, the upstream client, the prefix key and the rate limiter are
plain, fully typed Python. setup.py compiles them with mypyc into C extension modules beside
their sources (`pip install -e .`, which `make` runs): the same code, 15-20 % less of the
broker's CPU per proxied request (bench/README.md, "The compiled hot path").

Python loads an extension module before the source of the same name. An extension built from an
older source would run code that is no longer in the tree, so `install()` (called by
routing/__init__.py before any of them is imported) checks, and when

- any compiled module is older than its source (edited since the build),
- or the environment says CPN_PURE_PYTHON=1 (to profile line by line with py-spy, or to
  rule the compiled code out),

it has all of them loaded from source, and says why once. All or none: the compiled modules
call each other natively, so a mix would run two copies of the same classes.

This module imports the standard library only: setup.py reads MODULES from it before anything
is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["MODULES", "PURE_ENV", "compiled", "install", "state"]

log = logging.getLogger(__name__)

# Modules (dotted, as imported) that setup.py compiles. A module here must keep to what mypyc
# compiles: no pydantic models (their fields are class attributes), no subclass of a class
# from a C library other than the builtins' exceptions, no circular import in the group.
MODULES: tuple[str, ...] = (
    "routing.lane",
    "routing.proxy",
    "routing.upstream",
    "routing.prefix",
    "routing.ratelimit",
)
PURE_ENV = "CPN_PURE_PYTHON"
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


def _check(root: Path = _ROOT) -> str:
    """'compiled', or why the sources are loaded: 'not built', 'stale: ...', 'CPN_PURE_PYTHON'."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return PURE_ENV
    built = {name: _extension(name, root) for name in MODULES}
    if not any(built.values()):
        return "not built"
    missing = [f"{name} not built" for name, path in built.items() if path is None]
    edited = [
        f"{name} edited since the build"
        for name, path in built.items()
        if path is not None and _source(name, root).stat().st_mtime > path.stat().st_mtime
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
            "(rebuild: pip install -e . or make)",
            _state,
        )


def state() -> str:
    """'compiled', 'not built', 'CPN_PURE_PYTHON', or 'stale: ...' (what install() found)."""
    return _state


def compiled() -> bool:
    """Whether the hot path runs compiled in this process."""
    mod = sys.modules.get(MODULES[0])
    return mod is not None and not (getattr(mod, "__file__", "") or "").endswith(".py")
