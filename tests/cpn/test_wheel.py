"""The wheel (issue 48): built as an operator builds it, installed into a fresh venv outside the
repository, and run from there with nothing read from a checkout.

Two builds: pure Python (`CPN_COMPILE=0`, as where no compiler is), in the suite; and with the
compiled hot path (the C compiler and mypyc present, as `make native` left them: the build
reuses its objects, but mypyc generates its C again), run by `make wheel-check`, which CI runs
after `make test` (.ci/run). The fresh venv has no pip and no copy of the dependencies: it sees
the project's venv's site-packages through a .pth file (that directory's own .pth files, the
editable install's among them, are not read), so the only cpn it can import is the wheel's.
From a directory outside the repository, the installed `cpn version` names the package's
configs, and `cpn up` starts a demo site and its broker, which the installed `cpn sites` lists."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from sites.emulation.etcd_server import free_port
from tests.conftest import REPO

pytestmark = pytest.mark.e2e  # builds, installs and starts processes (tests/tiers.py)

SITE = "wuhu"  # a demo site on the local executor


def _wheel(out: Path, *, compiled: bool) -> Path:
    env = {**os.environ, "CPN_COMPILE": "1" if compiled else "0"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(out), str(REPO)],
        check=True, env=env, timeout=600, capture_output=True,
    )  # fmt: skip
    (wheel,) = out.glob("cpn-*.whl")
    return wheel


def _venv(where: Path, wheel: Path) -> Path:
    """A fresh venv holding `wheel`, the project's dependencies seen through a .pth file."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--disable-pip-version-check", "-q", str(wheel)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    return where / "bin"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CPN_", "PYTHON"))}
    return {**env, "CPN_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path / "home")}


def _run(bin_dir: Path, *args: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [str(bin_dir / "cpn"), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


@pytest.mark.timeout(600)  # the compiled build: mypyc's C generated again (a minute or more)
def test_the_wheel_installs_and_runs_outside_the_repository(tmp_path: Path) -> None:
    pure = _wheel(tmp_path / "pure", compiled=False)
    assert pure.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(pure) as z:
        names = set(z.namelist())
    assert "sites/_configs/devices.yaml" in names and f"sites/_configs/sites/{SITE}.yaml" in names
    assert "broker/api/static/dashboard/index.html" in names
    assert not any(n.endswith(".so") for n in names)
    away = tmp_path / "elsewhere"  # not the repository, nor under it
    away.mkdir()
    env = _env(tmp_path)

    bin_dir = _venv(tmp_path / "venv-pure", pure)
    info = json.loads(_run(bin_dir, "version", "-o", "json", cwd=away, env=env))
    assert info["hot_path"] == "not built" and info["configs_from"] == "package", info
    assert info["configs"].startswith(str(tmp_path / "venv-pure")), info
    # what an operator installs from it: the units (from the package's configs) and dashboards
    root = tmp_path / "root"
    _run(bin_dir, "systemd", "install", "--root", str(root), cwd=away, env=env)
    units = root / "etc" / "systemd" / "system"
    assert {"cpn-agent@.service", "cpn-broker.service"} <= {p.name for p in units.iterdir()}
    assert str(bin_dir / "cpn") in (units / "cpn-broker.service").read_text()
    _run(bin_dir, "dashboards", "export", str(tmp_path / "dashboards"), cwd=away, env=env)
    assert len(list((tmp_path / "dashboards").glob("*.json"))) == 5

    port = free_port()
    up = subprocess.Popen(
        [str(bin_dir / "cpn"), "up", "--sites", SITE, "--no-service", "--no-wan-emulation",
         "--broker-listen", f"127.0.0.1:{port}", "--interval", "1"],
        cwd=away, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            assert up.poll() is None, up.communicate()[0][-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    pass
                sites = json.loads(_run(bin_dir, "sites", "-o", "json", cwd=away, env=env))
                if any(s.get("id") == SITE and s.get("state") == "up" for s in sites):
                    break
            except (OSError, AssertionError, json.JSONDecodeError):
                pass
            assert time.monotonic() < deadline, "the installed cpn up did not bring its site up"
            time.sleep(0.5)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            out, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            out, _ = up.communicate()
    assert up.returncode == 0, out[-3000:]
    # nothing of the checkout named in what it ran (its dependencies, etcd's binary among
    # them, are the project venv's: the .pth above)
    assert not re.findall(re.escape(str(REPO)) + r"/(?!\.venv/)\S*", out), out[-3000:]


@pytest.mark.skipif(
    os.environ.get("CPN_TEST_COMPILED_WHEEL") != "1",
    reason="`make wheel-check` (CI, after `make test`): mypyc's C generated again takes a minute",
)
@pytest.mark.timeout(600)
def test_the_compiled_wheel_runs_its_hot_path_compiled(tmp_path: Path) -> None:
    compiled = _wheel(tmp_path / "compiled", compiled=True)
    with zipfile.ZipFile(compiled) as z:
        assert any(n.startswith("routing/hotpath__mypyc") for n in z.namelist())
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = _env(tmp_path)
    built = _venv(tmp_path / "venv-compiled", compiled)
    info = json.loads(_run(built, "version", "-o", "json", cwd=away, env=env))
    assert info["hot_path"] == "compiled", info
    assert info["configs_from"] == "package", info
    assert info["configs"].startswith(str(tmp_path / "venv-compiled")), info
