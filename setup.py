"""cpn's build: pyproject.toml has the metadata; this adds the compiled hot path.

routing.native.MODULES (the inference lane, proxy, upstream client, prefix key, rate limiter
and routing decision) are compiled by mypyc into C extension modules beside their sources.
Where that cannot be done (no C compiler or Python headers, or CPN_COMPILE=0), cpn installs as
pure Python and runs the same code from source: slower, not different.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _native() -> Any:
    spec = importlib.util.spec_from_file_location("_cpn_native", HERE / "routing" / "native.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_compiled_from: dict[str, str] = {}


def _ext_modules() -> list[Any]:
    if os.environ.get("CPN_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("cpn: mypyc is not installed; the hot path stays Python", file=sys.stderr)
        return []
    native = _native()
    _compiled_from.update(native.digests(HERE))  # before mypyc reads them
    paths = [name.replace(".", "/") + ".py" for name in native.MODULES]
    return list(mypycify(paths, opt_level="3", group_name=native.GROUP))


class OptionalBuildExt(build_ext):
    """Builds the extensions, or none of them: a failure leaves cpn pure Python, with a word.

    Then writes what they were compiled from (routing.native.BUILT: each source's sha256, taken
    before mypyc read them), which routing.native checks at every start."""

    def run(self) -> None:
        if not self.extensions:
            return
        package = HERE / "routing" if self.inplace else Path(self.build_lib) / "routing"
        built = package / _native().BUILT
        built.unlink(missing_ok=True)
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means: install as Python
            for output in self.get_outputs():
                Path(output).unlink(missing_ok=True)
            print(
                f"cpn: the compiled hot path was not built ({exc}); it stays Python",
                file=sys.stderr,
            )
            return
        package.mkdir(parents=True, exist_ok=True)
        built.write_text(json.dumps(_compiled_from, indent=1) + "\n")


class BuildPyWithConfigs(build_py):
    """The packages, and a copy of configs/ as sites/_configs (sites.model.configs_home): an
    installed cpn reads its device catalog, demo sites and the rest from the package, never
    from a checkout. Only into a build directory: an in-place or editable build keeps reading
    the repository's configs/."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "sites" / "_configs"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(
            HERE / "configs", target, ignore=shutil.ignore_patterns("state", "__pycache__")
        )


setup(
    ext_modules=_ext_modules(),
    cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithConfigs},
)
