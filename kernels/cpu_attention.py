"""Native CPU paged decode attention (``csrc/paged_decode_attention.c``), loaded with ctypes.

The torch reference (:func:`baton.kernels.paged_attention.decode_attention`) gathers every
sequence's blocks into a padded copy before attending; on a CPU, where decode attention is bound
by memory bandwidth, the copy costs more than the attention. This kernel reads the blocks in place.

It is built by :mod:`baton.kernels.native`. Without a compiler (or with ``BATON_NATIVE=0``),
:func:`load` returns ``None`` and the engine uses the torch reference; the backend in use is
reported by ``LLMEngine.attention_backend``.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from baton.kernels import native


@cache
def load() -> ctypes.CDLL | None:
    dll = native.build("paged_decode_attention",
                       ["-fopenmp", "-ffast-math", "-fno-finite-math-only", "-lmvec", "-lm"])
    if dll is None:
        return None
    dll.paged_decode_attention.restype = ctypes.c_int
    dll.paged_decode_attention.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
        + [ctypes.c_int64] * 5 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return dll


def decode_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, window: int = 0,
) -> torch.Tensor:
    """Same contract as the torch reference (``window`` included): q [B, Hq, D] float32 ->
    [B, Hq, D]. ``kv`` may be any strided view with the head dim contiguous (a KV-head-major
    pool, ``engine/kv_layout.py``)."""
    dll = load()
    assert dll is not None
    nb, num_layers, two, bs, hkv, d = kv.shape
    b, hq, dq = q.shape
    assert two == 2 and dq == d and hq % hkv == 0, (q.shape, kv.shape)
    assert kv.stride(5) == 1 and kv.dtype in (torch.float32, torch.bfloat16), (kv.stride(),
                                                                               kv.dtype)
    assert q.dtype == torch.float32 and block_tables.dtype == torch.int64
    assert block_tables.shape[0] == b and context_lens.shape == (b,)
    q = q.contiguous()
    bt = block_tables.contiguous()
    lens = context_lens.contiguous()
    out = torch.empty_like(q)
    rc = dll.paged_decode_attention(
        out.data_ptr(), q.data_ptr(), kv.data_ptr(), int(kv.dtype == torch.bfloat16),
        bt.data_ptr(), lens.data_ptr(), b, bt.shape[1], layer, kv.stride(0), kv.stride(1),
        kv.stride(2), kv.stride(3), kv.stride(4), bs, hkv, hq // hkv, d, scale, window,
        torch.get_num_threads())
    assert rc == 0, f"unsupported shape for the native kernel: group={hq // hkv} dim={d} bs={bs}"
    return out


@cache
def load_prefill() -> ctypes.CDLL | None:
    dll = native.build("prefill_attention", ["-fopenmp", "-lm"])
    if dll is None:
        return None
    dll.prefill_attention_supported.restype = ctypes.c_int
    dll.prefill_attention_supported.argtypes = [ctypes.c_int, ctypes.c_int]
    dll.prefill_attention.restype = ctypes.c_int
    dll.prefill_attention.argtypes = (
        [ctypes.c_void_p] * 4 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return dll


def prefill_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`prefill_attention` runs ``dtype`` inputs of ``head_dim`` on this CPU (it
    needs AVX-512, and AVX512-BF16 for bf16; head_dim 64, 128 or 256)."""
    dll = load_prefill()
    return (dll is not None and dtype in (torch.float32, torch.bfloat16)
            and bool(dll.prefill_attention_supported(int(dtype == torch.bfloat16), head_dim)))


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_past: int, scale: float,
    window: int = 0, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as the torch reference (:func:`baton.kernels.paged_attention.
    prefill_attention`, ``window`` included): q [n, Hq, D], k and v [num_past + n, Hkv, D], all
    bf16 or all float32.
    Writes ``out`` (a contiguous [n, Hq, D], float32 or bf16; default: q's dtype) and returns it."""
    dll = load_prefill()
    assert dll is not None
    n, hq, d = q.shape
    hkv = k.shape[1]
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16), (
        q.dtype, k.dtype, v.dtype)
    assert k.shape == v.shape == (num_past + n, hkv, d) and hq % hkv == 0, (q.shape, k.shape)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.is_contiguous(), (out.shape, q.shape)
    assert out.dtype in (torch.float32, torch.bfloat16), out.dtype
    rc = dll.prefill_attention(
        out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), int(q.dtype == torch.bfloat16),
        int(out.dtype == torch.bfloat16), n, num_past, hkv, hq // hkv, d, scale, window,
        torch.get_num_threads())
    if rc == 3:
        raise MemoryError(f"prefill attention: no memory to pack {num_past + n} keys")
    assert rc == 0, f"prefill attention cannot run here: dtype={q.dtype} head_dim={d} (rc={rc})"
    return out
