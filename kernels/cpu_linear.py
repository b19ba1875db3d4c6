"""Native CPU linear layer for a few rows (``csrc/small_m_linear.c``), loaded with ctypes.

``y = x @ w.T + bias`` with ``x`` float32 [M, K] and ``w`` [N, K] in float32 or bfloat16. For decode
steps (M of one to a few rows) the layer is bound by how fast ``w`` streams from memory: this kernel
reads it sequentially at close to the machine's read bandwidth, where CPU BLAS reaches about a
third of it on this shape, and reads bfloat16 weights at half the bytes of float32 with float32
arithmetic (CPUs without native bf16 run bf16 BLAS far slower than float32).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from baton.kernels import native


@cache
def load() -> ctypes.CDLL | None:
    dll = native.build("small_m_linear", ["-fopenmp"])
    if dll is None:
        return None
    dll.small_m_linear.restype = ctypes.c_int
    dll.small_m_linear.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p]
                                   + [ctypes.c_int64] * 3 + [ctypes.c_int])
    return dll


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32, w [N, K] float32/bfloat16 contiguous, bias [N] float32 -> [M, N]."""
    dll = load()
    assert dll is not None
    assert x.dtype == torch.float32 and w.dtype in (torch.float32, torch.bfloat16), (x.dtype,
                                                                                      w.dtype)
    assert w.is_contiguous() and x.shape[-1] == w.shape[1], (x.shape, w.shape)
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    if bias is not None:
        bias = bias.float().contiguous()
    rc = dll.small_m_linear(y.data_ptr(), x.data_ptr(), w.data_ptr(), int(w.dtype == torch.bfloat16),
                            None if bias is None else bias.data_ptr(), m, n, k,
                            torch.get_num_threads())
    assert rc == 0
    return y
