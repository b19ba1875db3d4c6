"""Fused elementwise Triton kernels for the engine on CUDA.

A decode step of a small batch is a chain of short kernels between the weight reads; each one
that is folded into a neighbour is one launch and one round trip of activations fewer:

- ``add_rms_norm``: the residual add and the next RMSNorm in one pass (``h += delta`` in place);
- ``rope_store_kv``: rotary embedding of the query and key heads, and the new keys and values
  written into their KV-cache slots, straight from the fused qkv projection's output;
- ``silu_mul``: SwiGLU's ``silu(gate) * up`` on the fused gate/up projection's output.

Arithmetic is float32 inside, rounded once to the model's dtype; RMSNorm rounds the normalized
value to the dtype before the weight multiplies it, as the CPU engine (and Hugging Face) do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from baton.kernels import triton_fp8
from baton.kernels.triton_fp8 import to_fp8


@triton.jit
def _rms_norm_kernel(
    h_ptr, d_ptr, w_ptr, out_ptr, n_cols, eps, stride_h, stride_d, stride_o,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(h_ptr + row * stride_h + cols, mask=m, other=0.0)
    if HAS_DELTA:
        x = x + tl.load(d_ptr + row * stride_d + cols, mask=m, other=0.0)
        tl.store(h_ptr + row * stride_h + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``h += delta`` (in place, when given), then ``rms_norm(h) * weight``. h, delta: [T, C]."""
    assert h.dim() == 2 and h.stride(1) == 1, "h must be [T, C] with contiguous rows"
    t, c = h.shape
    assert weight.shape == (c,) and weight.is_contiguous()
    if delta is not None:
        assert delta.shape == h.shape and delta.stride(1) == 1 and delta.dtype == h.dtype
    out = torch.empty_like(h) if out is None else out
    if t:
        _rms_norm_kernel[(t,)](
            h, h if delta is None else delta, weight, out, c, eps, h.stride(0),
            0 if delta is None else delta.stride(0), out.stride(0),
            HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(c), num_warps=4,
        )
    return out


@triton.jit
def _rope_store_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, blk_ptr, off_ptr, kvs_ptr,
    stride_qkv, stride_cs, stride_q, stride_cb, stride_co, stride_ch,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, KV_FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program t: token t's row of qkv = [q heads | k heads | v heads], each head D = 2 * HALF.
    KV_FP8: keys and values are stored divided by the layer's scales (``kvs`` [2]) as FP8."""
    t = tl.program_id(0).to(tl.int64)
    d = 2 * HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    cmask = offs < HALF
    # rotate-half: out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin (cos/sin halves equal)
    cos = tl.load(cos_ptr + pos * stride_cs + offs, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cs + offs, mask=cmask, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv

    hq = tl.arange(0, HQ_PAD)
    mq = (hq < HQ)[:, None] & cmask[None, :]
    x1 = tl.load(row + hq[:, None] * d + offs[None, :], mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(row + hq[:, None] * d + HALF + offs[None, :], mask=mq, other=0.0).to(tl.float32)
    qo = q_ptr + t * stride_q + hq[:, None] * d + offs[None, :]
    tl.store(qo, (x1 * cos[None, :] - x2 * sin[None, :]).to(q_ptr.dtype.element_ty), mask=mq)
    tl.store(qo + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(q_ptr.dtype.element_ty),
             mask=mq)

    blk = tl.load(blk_ptr + t).to(tl.int64)
    if blk >= 0:  # negative: a padding row of a CUDA-graph batch, nothing to store
        slot = blk * stride_cb + tl.load(off_ptr + t).to(tl.int64) * stride_co
        _store_kv_row(row + HQ * d, cos, sin, offs, cmask, kc_ptr + slot, vc_ptr + slot, kvs_ptr,
                      stride_ch, HKV, HKV_PAD, HALF, KV_FP8, INTERPRETED)


@triton.jit
def _store_kv_row(src, cos, sin, offs, cmask, ko_ptr, vo_ptr, kvs_ptr, stride_ch,
                  HKV: tl.constexpr, HKV_PAD: tl.constexpr, HALF: tl.constexpr,
                  KV_FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """One token's keys (rotated) and values from ``src`` = [k heads | v heads] into its slot
    (heads ``stride_ch`` apart there): in the cache's dtype, or divided by the layer's scales
    as FP8 (KV_FP8)."""
    d = 2 * HALF
    hk = tl.arange(0, HKV_PAD)
    mk = (hk < HKV)[:, None] & cmask[None, :]
    at = hk[:, None] * d + offs[None, :]
    to = hk[:, None].to(tl.int64) * stride_ch + offs[None, :]
    k1 = tl.load(src + at, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(src + at + HALF, mask=mk, other=0.0).to(tl.float32)
    ks, vs = 1.0, 1.0
    if KV_FP8:
        ks, vs = tl.load(kvs_ptr), tl.load(kvs_ptr + 1)
    dt = ko_ptr.dtype.element_ty
    tl.store(ko_ptr + to, _kv_value(k1 * cos[None, :] - k2 * sin[None, :], ks, dt, KV_FP8,
                                    INTERPRETED), mask=mk)
    tl.store(ko_ptr + to + HALF, _kv_value(k2 * cos[None, :] + k1 * sin[None, :], ks, dt,
                                           KV_FP8, INTERPRETED), mask=mk)
    for half in range(2):
        v = tl.load(src + HKV * d + at + half * HALF, mask=mk, other=0.0).to(tl.float32)
        tl.store(vo_ptr + to + half * HALF, _kv_value(v, vs, dt, KV_FP8, INTERPRETED), mask=mk)


@triton.jit
def _kv_value(x, scale, dtype: tl.constexpr, KV_FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """A float32 key or value as the cache stores it: in its dtype, or FP8 of ``x / scale``
    (clamped to FP8's range: a value beyond it saturates, never becomes NaN)."""
    if KV_FP8:
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        return to_fp8(y, dtype, INTERPRETED)
    return x.to(dtype)


def rope_store_kv(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv: torch.Tensor, layer: int, block_ids: torch.Tensor, offsets: torch.Tensor,
    num_heads: int, out: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the query and key heads of ``qkv`` ([T, (Hq + 2 Hkv) * D]) at ``positions`` ([T]),
    store the rotated keys and the values at (``block_ids``, ``offsets``) of layer ``layer`` in
    the KV cache (block id < 0: skip), and return the rotated queries [T, Hq, D].
    cos, sin: [max_position, D], each row's two halves equal (rotate-half convention).
    An FP8 cache stores keys and values divided by ``kv_scales[layer]`` (float32 [L, 2])."""
    assert kv.dim() == 6 and kv.stride(5) == 1  # any layout (engine/kv_layout.py)
    _, _, _, _, hkv, d = kv.shape
    t = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * hkv) * d and qkv.stride(1) == 1
    assert d % 2 == 0 and cos.shape == sin.shape and cos.shape[1] == d and cos.stride(1) == 1
    assert positions.shape == block_ids.shape == offsets.shape == (t,)
    out = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device) if out is None \
        else out
    assert out.shape == (t, num_heads, d) and out.is_contiguous()
    if t:
        kc, vc = kv[:, layer, 0], kv[:, layer, 1]
        fp8 = kv.dtype == triton_fp8.FP8
        assert not fp8 or kv_scales is not None, "an FP8 KV cache needs its scales"
        _rope_store_kernel[(t,)](
            qkv, positions, cos, sin, out, kc, vc, block_ids, offsets,
            kv_scales[layer] if fp8 else out,
            qkv.stride(0), cos.stride(0), out.stride(0), kc.stride(0), kc.stride(1),
            kc.stride(2), HQ=num_heads, HKV=hkv, HQ_PAD=triton.next_power_of_2(num_heads),
            HKV_PAD=triton.next_power_of_2(hkv), HALF=d // 2,
            HALF_PAD=triton.next_power_of_2(d // 2), KV_FP8=fp8,
            INTERPRETED=triton_fp8.INTERPRETED, num_warps=4,
        )
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=m, other=0.0).to(tl.float32)
    # silu rounded to the dtype first, as torch's silu-then-multiply does
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] = [gate | up]. Returns silu(gate) * up: [T, I]."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0),
                                                       BLOCK=block, num_warps=4)
    return out
