"""broker.placement.settings' site_keys: the keys the sites' model servers require, read when the
broker
starts (the proxy's use of them: tests/routing/gateway/test_proxy.py; end to end:
tests/routing/test_gateway_e2e.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from broker.placement.settings import InferenceSettings, load_settings, read_site_keys
from sites.model.errors import ConfigError
from tests.conftest import CONFIGS, REPO, cpn_cmd


def settings(tmp_path: Path, site_keys: list[dict[str, object]]) -> InferenceSettings:
    path = tmp_path / "broker.yaml"
    path.write_text(yaml.safe_dump({"inference": {"site_keys": site_keys}}))
    return load_settings(path).inference


def test_keys_come_from_the_environment_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKYO_KEY", " sk-tokyo \n")
    (tmp_path / "frankfurt.key").write_text("sk-frankfurt\n")
    inference = settings(
        tmp_path,
        [
            {"site": "tokyo", "service": "qwen-72b", "key_env": "TOKYO_KEY"},
            {"site": "frankfurt", "key_file": str(tmp_path / "frankfurt.key")},
        ],
    )
    assert read_site_keys(inference, "broker.yaml") == {
        ("tokyo", "qwen-72b"): "sk-tokyo",
        ("frankfurt", "*"): "sk-frankfurt",
    }
    assert "sk-" not in repr(inference)  # the settings hold where the key is, not the key


@pytest.mark.parametrize(
    ("entry", "field", "reason"),
    [
        ({"site": "a", "key_env": "CPN_TEST_NO_SUCH_KEY"}, "key_env", "is not set"),
        ({"site": "a", "key_file": "/nonexistent/key"}, "key_file", "cannot read"),
        ({"site": "a", "key_file": "EMPTY"}, "key_file", "is empty"),
        ({"site": "a", "key_file": "TWO_LINES"}, "key_file", "on one line"),
    ],
)
def test_a_key_that_cannot_be_read_names_its_entry(
    tmp_path: Path, entry: dict[str, str], field: str, reason: str
) -> None:
    (tmp_path / "EMPTY").write_text("\n")
    (tmp_path / "TWO_LINES").write_text("sk-a\nX-Injected: 1\n")
    if entry.get("key_file") in ("EMPTY", "TWO_LINES"):
        entry = {**entry, "key_file": str(tmp_path / entry["key_file"])}
    inference = settings(tmp_path, [{"site": "ok", "key_env": "PATH"}, entry])
    with pytest.raises(ConfigError) as err:
        read_site_keys(inference, "broker.yaml")
    assert str(err.value).startswith(f"broker.yaml: inference.site_keys[1].{field}: ")
    assert reason in str(err.value)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"site": "a"}], "key_env or its key_file"),
        ([{"site": "a", "key_env": "X", "key_file": "/k"}], "key_env or its key_file"),
        ([{"site": "a", "key_env": "X"}, {"site": "a", "key_env": "Y"}], "two keys for site 'a'"),
        ([{"site": "a", "key_env": "X", "password": "p"}], "password"),
    ],
)
def test_a_bad_entry_is_a_config_error(
    tmp_path: Path, entries: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        settings(tmp_path, entries)
    assert "inference" in str(err.value) and message in str(err.value)


@pytest.mark.e2e
def test_the_broker_refuses_to_start_without_a_key_it_names(tmp_path: Path) -> None:
    """Exit 2 with one line naming the entry: before the broker connects to etcd or listens."""
    cfg = tmp_path / "configs"
    shutil.copytree(CONFIGS, cfg)
    keys = [{"site": "tokyo", "key_env": "CPN_TEST_UNSET_TOKYO_KEY"}]
    (cfg / "broker.yaml").write_text(yaml.safe_dump({"inference": {"site_keys": keys}}))
    out = subprocess.run(
        cpn_cmd("broker", "--etcd", "http://127.0.0.1:9", "--listen", "127.0.0.1:0",
                "--config-dir", str(cfg)),
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert "inference.site_keys[0].key_env" in out.stderr
    assert "CPN_TEST_UNSET_TOKYO_KEY is not set" in out.stderr
