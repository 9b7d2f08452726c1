"""routing.native: the compiled hot path is loaded only when it was built from the sources there.

The staleness rules are checked on a copy of the package (mtimes kept), so the checkout's own
build is neither used nor touched; what this checkout loads is checked in a fresh interpreter.
"""

from __future__ import annotations

import ast
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
import json, routing, routing.native as n, routing.gateway.lane as lane, routing.gateway.proxy as p
files = [lane.__file__, p.__file__]
print(json.dumps({"state": n.state(), "compiled": n.compiled(), "files": files}))
"""

needs_build = pytest.mark.skipif(
    native._check() == "not built",
    reason="the hot path is not compiled in this checkout (no C compiler at `make`)",
)


def _probe(cwd: Path, **env: str) -> dict[str, object]:
    """PROBE in a fresh interpreter, in `cwd`: as `cpn` runs anywhere (not the repository)."""
    environ = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "routing", tmp_path / "routing", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


@pytest.mark.e2e
@needs_build
def test_this_checkout_runs_its_build_and_pure_python_on_request(tmp_path: Path) -> None:
    got = _probe(tmp_path)
    assert got["state"] == "compiled"
    assert got["compiled"] is True
    assert not any(str(f).endswith(".py") for f in got["files"])  # type: ignore[attr-defined]

    got = _probe(tmp_path, CPN_PURE_PYTHON="1")
    assert got["state"] == "CPN_PURE_PYTHON"
    assert got["compiled"] is False
    gateway = ROOT / "routing" / "gateway"
    assert got["files"] == [str(gateway / "lane.py"), str(gateway / "proxy.py")]


@needs_build
def test_a_module_edited_or_missing_since_the_build_is_stale(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    assert native._check(tree) == "compiled"
    source = tree / "routing" / "gateway" / "upstream.py"
    later = time.time() + 5
    os.utime(source, (later, later))
    assert native._check(tree) == "compiled"  # touched, not edited: what was compiled is there
    source.write_text(source.read_text() + "# edited\n")
    assert native._check(tree) == "stale: routing.gateway.upstream edited since the build"
    for ext in (tree / "routing" / "gateway").glob("prefix.*.so"):
        ext.unlink()
    assert native._check(tree) == (
        "stale: routing.gateway.prefix not built, routing.gateway.upstream edited since the build"
    )
    for ext in (tree / "routing").glob("hotpath__mypyc.*.so"):
        ext.unlink()
    assert native._check(tree) == (
        "stale: routing.gateway.prefix not built, routing.hotpath__mypyc (their shared library) "
        "not built, routing.gateway.upstream edited since the build"
    )
    (tree / "routing" / native.BUILT).unlink()  # a build that did not finish writes none
    assert "routing.gateway.lane edited since the build" in native._check(tree)


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
    assert (
        finder.find_spec("routing.decision.explain", None) is None
    )  # not compiled: the usual finders
    assert finder.find_spec("json", None) is None


def test_compiled_modules_keep_to_what_mypyc_compiles() -> None:
    """What mypy accepts and mypyc does not, in routing.native.MODULES: a pydantic model (its
    fields fail at import), and one `except ... as name` for two exception types in a function
    (mypyc types the name once: the second raises TypeError when it catches)."""
    for name in native.MODULES:
        source = native._source(name)
        tree = ast.parse(source.read_text(), str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                modules += [alias.name for alias in node.names]
                assert not any(m.split(".")[0] == "pydantic" for m in modules), (
                    f"{source}:{node.lineno}: pydantic in a compiled module "
                    "(routing.decision.settings)"
                )
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                caught: dict[str, str] = {}
                for handler in ast.walk(node):
                    if isinstance(handler, ast.ExceptHandler) and handler.name:
                        kind = ast.unparse(handler.type) if handler.type else ""
                        first = caught.setdefault(handler.name, kind)
                        assert first == kind, (
                            f"{source}:{handler.lineno}: `as {handler.name}` catches {kind} "
                            f"after {first} in {node.name}: give it a name of its own"
                        )


@pytest.mark.e2e
@needs_build
def test_the_sources_still_pass_as_python() -> None:
    """Where no compiler is, the same modules run as Python: the lane's, the proxy's and the
    routing decision's tests on them (this suite runs them compiled)."""
    tests = [
        "tests/routing/gateway/test_lane.py",
        "tests/routing/gateway/test_proxy.py",
        "tests/routing/decision/test_pick.py",
    ]
    environ = {**os.environ, native.PURE_ENV: "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
