"""`cpn data`: the CLI process against an in-process broker and real site data stores (the
fixture of tests/broker/api/test_datasets.py): put, ls, describe, share, replicate, get (bytes
checked), rm; bad input exits 2 with one line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sites.model import keys
from sites.registry.client import Registry
from tests.broker.api import test_datasets as datasets_api
from tests.broker.api.test_datasets import Fed
from tests.conftest import AUTH, REPO

fed = datasets_api.fed  # the in-process broker and site data stores, as its tests use them

pytestmark = [
    pytest.mark.e2e,  # starts processes (tests/tiers.py)
    pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning"),
]


async def cpn(fed: Fed, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """`cpn ARGS` in a process of its own, while this loop serves the broker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPN_")}
    env["CPN_CONFIG"] = os.environ["CPN_CONFIG"]  # the tests' (none)
    env["CPN_BROKER"] = fed.url
    env["CPN_TOKEN"] = token or AUTH["Authorization"].removeprefix("Bearer ")
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "cpn", *args], capture_output=True, text=True,
        timeout=60, env=env, cwd=REPO,
    )  # fmt: skip


async def test_put_ls_describe_share_get_rm(fed: Fed, registry: Registry, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"hello\n")
    (src / "sub" / "b.bin").write_bytes(os.urandom(300_000))
    acme = await fed.token("acme")
    put = await cpn(fed, "data", "put", "corpus", str(src), "--region", "west", token=acme)
    assert put.returncode == 0, put.stderr
    assert "acme/corpus@1" in put.stdout and "at west" in put.stdout, put.stdout
    listed = await cpn(fed, "data", "ls", "-o", "json", token=acme)
    assert [d["name"] for d in json.loads(listed.stdout)] == ["corpus"], listed.stderr
    described = await cpn(fed, "data", "describe", "corpus@1", token=acme)
    assert described.returncode == 0 and "2" in described.stdout, described.stderr
    # another tenant: not there, until shared
    rival = await fed.token("rival")
    hidden = await cpn(fed, "data", "describe", "acme/corpus", token=rival)
    assert hidden.returncode == 2 and "no dataset acme/corpus" in hidden.stderr, hidden.stderr
    shared = await cpn(fed, "data", "share", "corpus", "rival", token=acme)
    assert shared.returncode == 0 and "rival" in shared.stdout, shared.stderr
    dest = tmp_path / "dest"
    got = await cpn(fed, "data", "get", "acme/corpus", str(dest), token=rival)
    assert got.returncode == 0, got.stderr
    for rel in ("a.txt", "sub/b.bin"):
        assert (dest / rel).read_bytes() == (src / rel).read_bytes()
    refused = await cpn(fed, "data", "rm", "acme/corpus", token=rival)
    assert refused.returncode == 2, refused.stderr
    ordered = await cpn(fed, "data", "replicate", "corpus", "--to", "east-a", token=acme)
    assert ordered.returncode == 0 and "ordered to east-a from west" in ordered.stdout, ordered
    removed = await cpn(fed, "data", "rm", "corpus", token=acme)
    assert removed.returncode == 0, removed.stderr
    assert await registry.get_raw(keys.dataset_meta("acme", "corpus")) is None


@pytest.mark.parametrize(
    "args",
    [
        ("data", "replicate", "x"),
        ("data", "replicate", "x", "--to", "a", "--region", "b"),
        ("data", "put", "x", "/nonexistent/path"),
        ("data", "describe", "Bad!Name"),
        ("data", "describe", "x@0"),
        ("data", "share", "x@2", "t"),
        ("data", "get", "nope", "somewhere"),
    ],
)
async def test_bad_input_exits_2_with_one_line(fed: Fed, args: tuple[str, ...]) -> None:
    acme = await fed.token("acme")
    done = await cpn(fed, *args, token=acme)
    assert done.returncode == 2, (args, done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("cpn: error:"), done.stderr
