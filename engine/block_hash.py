"""The block-hash contract shared by the engine, the prefix index and the router.

A full block of ``block_size`` token ids is identified by a chained SHA-256 hash:

    hash(block i) = sha256(b"baton-block-v1" | parent | namespace | token ids as little-endian u32)

where ``parent`` is the hash of block i-1 (32 zero bytes for block 0) and ``namespace`` is
:func:`namespace_for` (model fingerprint + the request's cache salt). Identical prefixes therefore
get identical hashes in every process and on every machine (no Python ``hash()``, no seeds), a
block's hash commits to everything before it, and different models or tenants never share entries.

This module imports nothing heavier than ``hashlib`` so that the router can use it without torch.
Long chains go through a small native helper (``kernels/csrc/block_hash.c``, OpenSSL's SHA-256,
same bytes) when a C compiler is available; ``BATON_NATIVE=0`` keeps everything in Python.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import struct
import sys
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
    skipped)."""
    raw = hash_chain(token_ids, block_size, namespace, parent)
    return [raw[i : i + 32] for i in range(0, len(raw), 32)]


def hash_chain(
    token_ids: Sequence[int],
    block_size: int,
    namespace: bytes,
    parent: bytes | None = None,
) -> bytes:
    """:func:`hash_blocks`, concatenated (32 bytes per block): what the router sends to the
    Redis index. Same bytes as :func:`hash_block` in a loop; long chains are hashed natively."""
    n = len(token_ids) // block_size
    if n == 0:
        return b""
    data = _u32le(token_ids, n * block_size)
    p = parent if parent is not None else ROOT_PARENT
    if n >= _NATIVE_MIN_BLOCKS and len(namespace) == 32 and len(p) == 32:
        native = _native()
        if native is not None:
            out = ctypes.create_string_buffer(32 * n)
            if native(*_SHA256, HASH_VERSION, len(HASH_VERSION), p, namespace, data,
                      4 * block_size, n, out) == 0:
                return out.raw
    step, base = 4 * block_size, hashlib.sha256(HASH_VERSION)
    out_list: list[bytes] = []
    for i in range(0, n * step, step):
        h = base.copy()
        h.update(p)
        h.update(namespace)
        h.update(data[i : i + step])
        p = h.digest()
        out_list.append(p)
    return b"".join(out_list)


def _u32le(token_ids: Sequence[int], n: int) -> bytes:
    """The first ``n`` ids as little-endian u32 (array's machine order, swapped if need be:
    ~2x faster than struct.pack for long prompts)."""
    try:
        a = array.array("I", token_ids[:n])
    except (OverflowError, TypeError):  # not u32: struct raises its usual error below
        a = None
    if a is None or a.itemsize != 4:
        return struct.pack(f"<{n}I", *token_ids[:n])
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


_NATIVE_MIN_BLOCKS = 8  # below this, ctypes' call overhead outweighs the gain
_SHA256 = None
_native_fn: object = False  # False: not tried yet; None: unavailable


def _native():
    """The native chain function, built on first use; None without a compiler or libcrypto."""
    global _native_fn, _SHA256
    if _native_fn is False:
        _native_fn = None
        try:
            import ctypes.util

            from baton.kernels.native import build

            crypto = ctypes.util.find_library("crypto")
            lib = build("block_hash", [], torch_runtime=False) if crypto else None
            if lib is not None:
                libcrypto = ctypes.CDLL(crypto)
                _SHA256 = tuple(ctypes.cast(getattr(libcrypto, f"SHA256_{name}"), ctypes.c_void_p)
                                for name in ("Init", "Update", "Final"))
                fn = lib.baton_chain_hash
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_char_p, ctypes.c_size_t,
                               ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                               ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
                _native_fn = fn
        except (OSError, AttributeError, ImportError):
            _native_fn = None
    return _native_fn
