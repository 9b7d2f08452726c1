"""sites.kits.sealed: a file sealed and opened whole; another key, another name, a flipped
byte, a chunk cut off or a file cut short are refused, and nothing is left of the opening."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sites.kits import sealed
from sites.kits.sealed import SealError, load_key, new_key, open_file, seal_file


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sealed, "CHUNK", 1024)


@pytest.mark.parametrize("size", [0, 1, 1024, 1025, 4096])
def test_a_sealed_file_opens_whole(tmp_path: Path, small_chunks: None, size: int) -> None:
    new_key(tmp_path / "k")
    key = load_key(tmp_path / "k")
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    body = os.urandom(size)
    (tmp_path / "a").write_bytes(body)
    seal_file(tmp_path / "a", tmp_path / "s", key, b"cpn-x")
    if size >= 16:  # a byte or two of random body turns up in random ciphertext by chance
        assert body not in (tmp_path / "s").read_bytes()
    open_file(tmp_path / "s", tmp_path / "b", key, b"cpn-x")
    assert (tmp_path / "b").read_bytes() == body


def test_what_is_not_the_sealed_file_is_refused(tmp_path: Path, small_chunks: None) -> None:
    new_key(tmp_path / "k")
    new_key(tmp_path / "other")
    with pytest.raises(FileExistsError):
        new_key(tmp_path / "k")  # never over a key
    key = load_key(tmp_path / "k")
    (tmp_path / "a").write_bytes(os.urandom(3000))  # three chunks
    seal_file(tmp_path / "a", tmp_path / "s", key, b"cpn-x")
    good = (tmp_path / "s").read_bytes()
    chunk = 1024 + 16
    cases = {
        "another key": (good, load_key(tmp_path / "other"), b"cpn-x"),
        "another name": (good, key, b"cpn-y"),
        "a flipped byte": (good[:100] + bytes([good[100] ^ 1]) + good[101:], key, b"cpn-x"),
        "the last chunk cut off": (good[: 16 + 2 * chunk], key, b"cpn-x"),
        "cut short": (good[:16], key, b"cpn-x"),
        "not sealed": (b"plain text", key, b"cpn-x"),
    }
    for what, (raw, k, context) in cases.items():
        (tmp_path / "bad").write_bytes(raw)
        with pytest.raises(SealError):
            open_file(tmp_path / "bad", tmp_path / "out", k, context)
        assert not (tmp_path / "out").exists(), what
    (tmp_path / "junk").write_text("not base64 !!")
    with pytest.raises(SealError, match="not a key"):
        load_key(tmp_path / "junk")
