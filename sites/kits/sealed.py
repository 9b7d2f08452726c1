"""A file sealed with a key kept elsewhere: AES-256-GCM in chunks, so a file of GBs is sealed
and opened in constant memory, and any change (a flipped byte, a chunk cut, dropped, moved or
appended, another file's chunk) fails the opening instead of giving wrong bytes.

    magic "CPNSEAL1" | nonce prefix (8 random bytes) | chunk... each sealed with
    nonce = prefix || index (4 bytes, big endian), AAD = context || index || last (1 byte)

`context` binds the file to what it is (a backup's name): a sealed file renamed is not opened as
another. The key is 32 random bytes, kept base64 in a file of its own (0600): `new_key`.
What uses it: the backups' copies at the sites (broker.ops.backup_copies, docs/backup.md).
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
import struct
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["SealError", "load_key", "new_key", "open_file", "seal_file"]

MAGIC = b"CPNSEAL1"
CHUNK = 1 << 20  # plaintext per chunk
TAG = 16
KEY_BYTES = 32


class SealError(ValueError):
    """A key that is not one, or a sealed file that cannot be opened with it (one line)."""


def new_key(path: Path) -> None:
    """Make a key at `path` (0600); never over one that exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode() + "\n")
        f.flush()
        os.fsync(f.fileno())


def load_key(path: Path) -> bytes:
    try:
        raw = base64.b64decode(path.read_text().strip(), validate=True)
    except (OSError, ValueError, binascii.Error) as exc:
        raise SealError(f"{path}: not a key ({exc})") from None
    if len(raw) != KEY_BYTES:
        raise SealError(f"{path}: a key is {KEY_BYTES} bytes, base64; this one is {len(raw)}")
    return raw


def _aad(context: bytes, index: int, last: bool) -> bytes:
    return context + struct.pack(">IB", index, 1 if last else 0)


def seal_file(src: Path, dst: Path, key: bytes, context: bytes) -> None:
    """`src` sealed into `dst` (blocking: call it in a thread)."""
    aead = AESGCM(key)
    prefix = secrets.token_bytes(8)
    size = src.stat().st_size
    chunks = max(1, -(-size // CHUNK))
    with open(src, "rb") as fin, open(dst, "wb") as out:
        out.write(MAGIC + prefix)
        for index in range(chunks):
            plain = fin.read(CHUNK)
            nonce = prefix + struct.pack(">I", index)
            last = index == chunks - 1
            out.write(aead.encrypt(nonce, plain, _aad(context, index, last)))
        out.flush()
        os.fsync(out.fileno())


def open_file(src: Path, dst: Path, key: bytes, context: bytes) -> None:
    """`src` opened into `dst`; SealError (and `dst` removed) when it cannot be, whole."""
    aead = AESGCM(key)
    try:
        with open(src, "rb") as fin, open(dst, "wb") as out:
            head = fin.read(len(MAGIC) + 8)
            if len(head) != len(MAGIC) + 8 or not head.startswith(MAGIC):
                raise SealError(f"{src.name}: not a sealed file")
            prefix = head[len(MAGIC) :]
            index = 0
            block = fin.read(CHUNK + TAG)
            while block:
                after = fin.read(CHUNK + TAG)
                nonce = prefix + struct.pack(">I", index)
                try:
                    out.write(aead.decrypt(nonce, block, _aad(context, index, not after)))
                except InvalidTag:
                    raise SealError(
                        f"{src.name}: cannot be opened with this key (another key, another "
                        f"file, or damaged at chunk {index})"
                    ) from None
                block, index = after, index + 1
            if index == 0:
                raise SealError(f"{src.name}: sealed file cut short")
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
