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


QUANT_TYPES = {"Q8_0": (0, 34), "Q4_0": (1, 18), "Q4_1": (2, 20)}  # kernel code, bytes a block
QUANT_MAX_K = 16384
ROUND_BF16 = 0x100  # or-ed into the kernel's block type (csrc/quant_linear.c)


class QuantWeight:
    """A [N, K] weight kept as its GGUF blocks: ``blocks`` uint8 [N, K / 32 * block bytes], each
    row its own run of 32-weight blocks (``qtype``: Q8_0, Q4_0 or Q4_1). :func:`linear` reads it
    directly; :func:`dequantize` gives the float32 matrix, equal bit for bit to the gguf
    package's. With ``round_bf16`` every weight is that value rounded to bf16 (to nearest even,
    as ``.to(torch.bfloat16)``): the weights of a bf16 engine made from the same file, which
    :func:`linear` then multiplies as a bf16 GEMM does."""

    __slots__ = ("qtype", "blocks", "shape", "round_bf16")

    def __init__(self, qtype: str, blocks: torch.Tensor, k: int, round_bf16: bool = False):
        code, nbytes = QUANT_TYPES[qtype]
        assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and k % 32 == 0
        assert blocks.shape[1] == k // 32 * nbytes, (qtype, blocks.shape, k)
        self.qtype, self.blocks, self.shape = qtype, blocks.contiguous(), (blocks.shape[0], k)
        self.round_bf16 = round_bf16

    @property
    def code(self) -> int:
        """The kernel's block type argument."""
        return QUANT_TYPES[self.qtype][0] | (ROUND_BF16 if self.round_bf16 else 0)

    @staticmethod
    def usable(qtype: str, k: int) -> bool:
        return (qtype in QUANT_TYPES and k % 32 == 0 and k <= QUANT_MAX_K
                and quant_load() is not None and quant_in_registers())


@cache
def quant_load() -> ctypes.CDLL | None:
    # no multiply-add may fuse in the dequantization: each weight must be the float32 value the
    # gguf package computes (a product, then a sum, each rounded)
    dll = native.build("quant_linear", ["-fopenmp", "-ffp-contract=off"])
    if dll is None:
        return None
    dll.quant_linear.restype = dll.quant_dequantize.restype = ctypes.c_int
    dll.quant_linear.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p]
                                 + [ctypes.c_int64] * 3 + [ctypes.c_int])
    dll.quant_dequantize.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int]
                                     + [ctypes.c_int64] * 2)
    dll.quant_in_registers.restype = ctypes.c_int
    return dll


@cache
def quant_in_registers() -> bool:
    """Whether the block-reading kernel dequantizes in registers (built with AVX-512). Only then
    does reading the blocks beat reading the float32 weights: without AVX-512 each row is
    dequantized to a buffer and summed serially (bit-exact float32 order), 10-17x slower than the
    float32 small-M kernel on SmolLM2's shapes (one row, one thread, 2-vCPU AVX2 EPYC), so the
    engine keeps the float32 copy there."""
    dll = quant_load()
    return dll is not None and bool(dll.quant_in_registers())


def dequantize(w: QuantWeight) -> torch.Tensor:
    dll = quant_load()
    assert dll is not None
    out = torch.empty(w.shape, dtype=torch.float32)
    rc = dll.quant_dequantize(out.data_ptr(), w.blocks.data_ptr(), w.code, *w.shape)
    assert rc == 0
    return out


def linear(x: torch.Tensor, w: torch.Tensor | QuantWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32, w [N, K] float32/bfloat16 contiguous or a :class:`QuantWeight`, bias [N]
    float32 -> [M, N]."""
    if isinstance(w, QuantWeight) and w.round_bf16:
        # what a bf16 GEMM computes (Linear's bf16 path): x rounded to bf16, float32 sums
        # rounded to bf16 once, the bias added in float32
        y = _quant_linear(x.bfloat16().float(), w, None).bfloat16().float()
        return y if bias is None else y + bias
    if isinstance(w, QuantWeight):
        return _quant_linear(x, w, bias)
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
    rc = dll.small_m_linear(y.data_ptr(), x.data_ptr(), w.data_ptr(),
                            int(w.dtype == torch.bfloat16),
                            None if bias is None else bias.data_ptr(), m, n, k,
                            torch.get_num_threads())
    assert rc == 0
    return y


def _quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    dll = quant_load()
    assert dll is not None
    assert x.dtype == torch.float32 and x.shape[-1] == w.shape[1], (x.shape, w.shape)
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.shape[0], dtype=torch.float32)
    if m == 0:
        return y
    if bias is not None:
        bias = bias.float().contiguous()
    rc = dll.quant_linear(y.data_ptr(), x.data_ptr(), w.blocks.data_ptr(), w.code,
                          None if bias is None else bias.data_ptr(),
                          m, w.shape[0], w.shape[1], torch.get_num_threads())
    assert rc == 0, (w.qtype, w.shape)
    return y
