"""The CLI's own conventions, apart from any command's logic."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import CONFIGS, REPO, cpn_cmd

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """`cpn jobs | head`: the reader leaves early; no traceback, no error, exit 0."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE
    try:
        sites = sorted(str(p) for p in (CONFIGS / "sites").glob("*.yaml"))
        done = subprocess.run(
            cpn_cmd("site", "validate", *sites),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_usage_errors_exit_2_with_one_line() -> None:
    done = subprocess.run(
        cpn_cmd("up", "--secure", "--etcd", "http://127.0.0.1:1"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "--secure" in done.stderr
