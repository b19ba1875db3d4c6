"""The block-hash contract shared by the engine, the prefix index and the router.

A full block of ``block_size`` token ids is identified by a chained SHA-256 hash:

    hash(block i) = sha256(b"baton-block-v1" | parent | namespace | token ids as little-endian u32)

where ``parent`` is the hash of block i-1 (32 zero bytes for block 0) and ``namespace`` is
:func:`namespace_for` (model fingerprint + the request's cache salt). Identical prefixes therefore
get identical hashes in every process and on every machine (no Python ``hash()``, no seeds), a
block's hash commits to everything before it, and different models or tenants never share entries.

This module imports nothing heavier than ``hashlib`` so that the router can use it without torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = b"baton-block-v1"
ROOT_PARENT = bytes(32)


def namespace_for(model_fingerprint: str, cache_salt: str | None = None) -> bytes:
    """The 32-byte namespace of a (model, cache salt) pair."""
    h = hashlib.sha256(b"baton-ns-v1\0")
    h.update(model_fingerprint.encode())
    h.update(b"\0")
    h.update((cache_salt or "").encode())
    return h.digest()


def hash_block(parent: bytes | None, namespace: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block given its parent's hash (``None`` for the first block)."""
    h = hashlib.sha256(HASH_VERSION)
    h.update(parent if parent is not None else ROOT_PARENT)
    h.update(namespace)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    namespace: bytes,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block is
    skipped). Same bytes as :func:`hash_block` in a loop; packs the ids once (a router hashes
    8k-token prompts per request)."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    data = struct.pack(f"<{n * block_size}I", *token_ids[: n * block_size])
    step, base = 4 * block_size, hashlib.sha256(HASH_VERSION)
    p = parent if parent is not None else ROOT_PARENT
    out: list[bytes] = []
    for i in range(0, n * step, step):
        h = base.copy()
        h.update(p)
        h.update(namespace)
        h.update(data[i : i + step])
        p = h.digest()
        out.append(p)
    return out
