"""routing.native: the compiled hot path is loaded only when it was built from the sources there.

The staleness rules are checked on a copy of the package (mtimes kept), so the checkout's own
build is neither used nor touched; what this checkout loads is checked in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from routing import native

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, routing, routing.native as n, routing.lane as lane, routing.proxy as p
files = [lane.__file__, p.__file__]
print(json.dumps({"state": n.state(), "compiled": n.compiled(), "files": files}))
"""

needs_build = pytest.mark.skipif(
    native._check() == "not built",
    reason="the hot path is not compiled in this checkout (no C compiler at `make`)",
)


def _probe(**env: str) -> dict[str, object]:
    environ = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "routing", tmp_path / "routing", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


@needs_build
def test_this_checkout_runs_its_build_and_pure_python_on_request() -> None:
    got = _probe()
    assert got["state"] == "compiled"
    assert got["compiled"] is True
    assert not any(str(f).endswith(".py") for f in got["files"])  # type: ignore[attr-defined]

    got = _probe(CPN_PURE_PYTHON="1")
    assert got["state"] == "CPN_PURE_PYTHON"
    assert got["compiled"] is False
    assert got["files"] == [str(ROOT / "routing" / "lane.py"), str(ROOT / "routing" / "proxy.py")]


@needs_build
def test_a_module_edited_or_missing_since_the_build_is_stale(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    assert native._check(tree) == "compiled"
    later = time.time() + 5
    os.utime(tree / "routing" / "upstream.py", (later, later))
    assert native._check(tree) == "stale: routing.upstream edited since the build"
    for ext in (tree / "routing").glob("prefix.*.so"):
        ext.unlink()
    assert (
        native._check(tree)
        == "stale: routing.prefix not built, routing.upstream edited since the build"
    )


def test_stale_or_unbuilt_modules_load_from_source(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    for ext in tree.rglob("*.so"):
        ext.unlink()
    assert native._check(tree) == "not built"
    finder = native._SourceFinder(tree)
    for name in native.MODULES:
        spec = finder.find_spec(name, None)
        assert spec is not None and spec.origin == str(
            tree.joinpath(*name.split(".")).with_suffix(".py")
        )
    assert finder.find_spec("routing.policy", None) is None  # not compiled: the usual finders
    assert finder.find_spec("json", None) is None
