"""A site file's inference token prices (prices.usd_per_million_tokens) are checked where site
files are read: a bad one (negative, not a number, an unknown field, a missing one) is refused
by config loading and by `cpn site join` (exit 2, one line), naming the field's whole path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sites.model.catalog import DeviceCatalog
from sites.model.config import parse_site
from sites.model.errors import ConfigError
from tests.conftest import run_cpn, site_doc

CATALOG = DeviceCatalog.load()
TOKENS = "prices.usd_per_million_tokens"


def with_tokens(table: dict[str, Any]) -> dict[str, Any]:
    doc = site_doc("s1")
    doc["prices"] = {**doc["prices"], "usd_per_million_tokens": table}
    return doc


BAD = [
    ({"qwen": {"input": -0.5, "output": 1.0}}, f"{TOKENS}.qwen.input", "greater than or equal"),
    ({"qwen": {"input": 0.5, "output": "cheap"}}, f"{TOKENS}.qwen.output", "valid number"),
    ({"*": {"input": 0.5, "output": 1, "cached_input": -1}}, f"{TOKENS}.*.cached_input", "greater"),
    ({"qwen": {"input": 0.5, "output": 1, "eur": 1}}, f"{TOKENS}.qwen.eur", "not permitted"),
    ({"qwen": {"input": 0.5}}, f"{TOKENS}.qwen.output", "required"),
    ({"qwen": 0.5}, f"{TOKENS}.qwen", "valid dictionary"),
]  # fmt: skip


def test_good_token_prices_load() -> None:
    spec = parse_site("s1.yaml", with_tokens({"qwen": {"input": 0.5, "output": 1.5}}), CATALOG)
    price = spec.prices.token_price("qwen")
    assert price is not None and (price.input, price.output) == (0.5, 1.5)
    assert spec.prices.token_price("llama") is None  # no '*': free


@pytest.mark.parametrize(("table", "field", "reason"), BAD)
def test_a_bad_token_price_names_its_field(table: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_site("s1.yaml", with_tokens(table), CATALOG)
    (problem,) = caught.value.problems
    assert problem.field == field, caught.value.problems
    assert reason in problem.reason.lower()


@pytest.mark.e2e  # runs `cpn`
def test_cpn_site_join_refuses_a_bad_token_price(tmp_path: Path) -> None:
    path = tmp_path / "s1.yaml"
    path.write_text(yaml.safe_dump(with_tokens(BAD[0][0])))
    got = run_cpn("site", "join", str(path), etcd_url="http://127.0.0.1:9")  # never reached
    assert got.returncode == 2, (got.stdout, got.stderr)
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert f"{TOKENS}.qwen.input" in got.stderr
