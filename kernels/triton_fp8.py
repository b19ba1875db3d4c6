"""FP8 matrix products on CUDA: FP8 weights with their checkpoint's scales, activations quantized
as they arrive.

A weight is float8_e4m3fn [N, K] with float32 scales [N, G]: one per output row and group of
``group`` columns (``G = ceil(K / group)``). Every checkpoint layout is a case of it, so fused
matrices (q, k and v stacked) keep each part's own scales: a 128x128 block scale is repeated on
its block's rows, a per-channel scale is its row's (G = 1), a per-tensor one every row's
(``baton.engine.fp8.expand_scale`` writes them so).

Activations are quantized dynamically, per row and the same column groups (amax / 448, so no
value clips), and the product is the sum over groups of ``(a_q . w_q) * a_scale * w_scale``: one
Triton kernel (:func:`matmul`), with the FP8 dot on the tensor cores. Per-row weights on a GPU
with FP8 cuBLAS (sm_89+, shapes multiples of 16) take ``torch._scaled_mm`` instead. The torch
reference is :func:`reference`; the tests run the kernels against it under the interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from baton.kernels.fp8_layout import groups

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK_M, BLOCK_N = 32, 64
MAX_BLOCK_K = 128
MIN_BLOCK_K = 32  # an FP8 tensor-core dot takes K tiles of 32 and more (sm_90)
# Triton's interpreter converts float32 to FP8 without carrying a rounded-up mantissa into the
# exponent (124.3 -> 64, not 128; Triton 3.9): interpreted kernels round to the FP8 grid in
# float32 first, which it converts exactly. Compiled kernels convert in hardware.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def to_fp8(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x`` (float32, within +-448) as e4m3 FP8, rounded to nearest."""
    if INTERPRETED:
        a = tl.abs(x)
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)  # subnormals: 2^-9 steps
        ulp = tl.exp2(e - 3.0)
        a = tl.minimum(tl.floor(a / ulp + 0.5) * ulp, 448.0)
        x = tl.where(x < 0, -a, a)
    return x.to(dtype)


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, K, G, stride_x,
                   GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    """Program (row, group): ``q = x / s`` in FP8 with ``s = amax / FP8_MAX`` of the group."""
    row, g = tl.program_id(0), tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, GROUP, BLOCK):
        offs = g * GROUP + c0 + tl.arange(0, BLOCK)
        mask = (c0 + tl.arange(0, BLOCK) < GROUP) & (offs < K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)))
    s = tl.maximum(tl.max(amax), 1e-12) / FP8_MAX
    for c0 in range(0, GROUP, BLOCK):
        offs = g * GROUP + c0 + tl.arange(0, BLOCK)
        mask = (c0 + tl.arange(0, BLOCK) < GROUP) & (offs < K)
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = to_fp8(x / s, q_ptr.dtype.element_ty, INTERPRETED)
        tl.store(q_ptr + row.to(tl.int64) * K + offs, q, mask=mask)
    tl.store(s_ptr + row * G + g, s)


@triton.jit
def _matmul(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, bias_ptr, M, N, K, G, stride_c,
            GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (m-block, n-block): ``c = sum_g (a_q . w_q)_g * a_scale[:, g] * w_scale[:, g]``.
    ``BLOCK_K`` divides ``GROUP`` (or G is 1), so a tile lies in one group."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        a = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        g = k0 // GROUP
        sa = tl.load(as_ptr + offs_m * G + g, mask=mmask, other=0.0)
        sw = tl.load(ws_ptr + offs_n * G + g, mask=nmask, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 [M, K], float32 scales [M, G]) of the rows of ``x`` [M, K], per ``group`` columns
    (0: per row)."""
    m, k = x.shape
    g = groups(k, group)
    span = k if g == 1 else group
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows[(m, g)](x, q, s, k, g, x.stride(0), GROUP=span,
                               BLOCK=min(1024, triton.next_power_of_2(span)), FP8_MAX=FP8_MAX,
                               INTERPRETED=INTERPRETED)
    return q, s


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantized(w).T + bias`` in x's dtype, with ``x`` [M, K] quantized per row and
    ``group`` columns: w FP8 [N, K], scale float32 [N, G]."""
    assert x.stride(-1) == 1 and w.is_contiguous() and scale.is_contiguous()
    xq, xs = quantize(x, group)
    if _scaled_mm_fits(x, w, scale):
        return scaled_mm(xq, xs, w, scale, x.dtype, bias)
    m, k = x.shape
    n, g = w.shape[0], scale.shape[1]
    span = k if g == 1 else group
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_k = max(MIN_BLOCK_K, min(MAX_BLOCK_K, span if g > 1 else
                                       triton.next_power_of_2(k)))
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _matmul[grid](xq, xs, w, scale, c, bias if bias is not None else c, m, n, k, g,
                      c.stride(0), GROUP=max(span, block_k), HAS_BIAS=bias is not None,
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k)
    return c


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
              dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch._scaled_mm`` with per-row scales on both sides: xq FP8 [M, K] with xs [M, 1],
    w FP8 [N, K] with scale [N, 1] (read column-major, as cuBLAS wants it)."""
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.t(), out_dtype=dtype)
    return y if bias is None else y + bias


def _scaled_mm_fits(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> bool:
    """Per-row weight scales on a GPU whose cuBLAS has row-wise scaled FP8 GEMMs, in the shapes
    it takes (K and N multiples of 16, a bf16 output)."""
    return (scale.shape[1] == 1 and x.is_cuda and x.dtype == torch.bfloat16
            and x.shape[1] % 16 == 0 and w.shape[0] % 16 == 0 and _rowwise_fp8(x.device))


@functools.cache
def _rowwise_fp8(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`matmul` in torch, float32: the same quantization of ``x``, then the dequantized
    operands multiplied."""
    k = x.shape[1]
    g = groups(k, group)
    span = k if g == 1 else group
    xf = x.float()
    cols = torch.arange(k, device=x.device) // span
    xs = torch.zeros(x.shape[0], g, device=x.device).scatter_reduce_(
        1, cols.expand(x.shape[0], k), xf.abs(), "amax").clamp_min(1e-12) / FP8_MAX
    xq = (xf / xs[:, cols]).to(FP8).float() * xs[:, cols]
    y = xq @ (w.float() * scale[:, cols]).T
    return y if bias is None else y + bias.float()
