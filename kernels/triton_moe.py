"""Mixture-of-experts MLP on CUDA: a grouped-expert Triton GEMM, one launch for all experts.

Each token's ``k`` (token, expert) pairs are sorted by expert on the device (no host sync, so a
decode step still runs in a CUDA graph); each expert's pairs are padded to whole tiles of
``BLOCK_M`` rows, and every program multiplies one tile of one expert's rows by that expert's
stacked weight: ``gate_up`` [E, 2I, H] then, after the activation, ``down`` [E, H, I] with each
pair's routing weight applied. A token's ``k`` results are summed at the end. The torch
reference is :func:`baton.engine.model.moe` (the CPU engine's grouped loop over expert hits);
the tests run this kernel against it under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from baton.kernels import triton_fp8

BLOCK_M = 16  # pairs per tile: decode batches are small, prefill tiles fill up


@triton.jit
def _grouped_gemm(
    a_ptr, w_ptr, c_ptr, pair_ptr, expert_ptr, scale_ptr, as_ptr, ws_ptr, n_pairs, N, K,
    a_row_div, G, stride_a, stride_we, stride_wn, stride_c,
    SCALE: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (tile, n-block): rows ``pair // a_row_div`` of ``a`` times expert ``e``'s
    [N, K] weight, into rows ``pair`` of ``c`` (times the pair's routing weight with SCALE).
    Tiles past the last expert's (expert -1) and padding rows (pair == n_pairs) do nothing.
    With FP8, ``a`` and the weights are FP8 with float32 scales per row and group of GROUP
    columns (``as`` [rows, G], ``ws`` [E, N, G]; see :mod:`baton.kernels.triton_fp8`)."""
    tile = tl.program_id(0)
    e = tl.load(expert_ptr + tile)
    if e >= 0:
        pairs = tl.load(pair_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < n_pairs
        rows = tl.where(valid, pairs // a_row_div, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            a = tl.load(a_ptr + rows[:, None] * stride_a + offs_k[None, :],
                        mask=valid[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            if FP8:
                g = k0 // GROUP
                sa = tl.load(as_ptr + rows * G + g, mask=valid, other=0.0)
                sw = tl.load(ws_ptr + e.to(tl.int64) * N * G + offs_n * G + g, mask=nmask,
                             other=0.0)
                acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
            else:
                acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
        if SCALE:
            acc *= tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
        out = c_ptr + tl.where(valid, pairs, 0).to(tl.int64)[:, None] * stride_c + offs_n[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, tile_experts) for the flattened expert choice of every (token, slot) pair
    ``experts`` [P]: ``pairs`` [max_tiles * block_m] lists the pairs expert by expert, each
    expert's run padded to whole tiles with ``P``; ``tile_experts`` [max_tiles] the expert of
    each tile, -1 past the last. ``max_tiles`` = ceil(P / block_m) + E bounds the tiles for any
    choice, so the shapes depend on P only (no host sync)."""
    p, dev = experts.shape[0], experts.device
    max_tiles = -(-p // block_m) + num_experts
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    tile_end = torch.cumsum(padded, 0)  # each expert's end in the padded order
    order = torch.argsort(experts, stable=True)
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in the sorted order
    chosen = experts[order]
    slot = tile_end[chosen] - padded[chosen] + torch.arange(p, device=dev) - first[chosen]
    pairs = torch.full((max_tiles * block_m,), p, dtype=torch.int64, device=dev)
    pairs.scatter_(0, slot, order)
    starts = torch.arange(max_tiles, device=dev) * block_m
    tile_experts = torch.searchsorted(tile_end, starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return pairs, tile_experts


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor,
                 tile_experts: torch.Tensor, n_pairs: int, a_row_div: int,
                 scale: torch.Tensor | None = None, fp8: tuple | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[n_pairs, N]: row ``p`` is ``a[p // a_row_div] @ w[expert of p].T`` (times
    ``scale[p]``). a: [*, K]; w: [E, N, K]. ``fp8``: (a's scales [*, G], w's [E, N, G], group)
    for FP8 ``a`` and ``w``, the result in ``out_dtype``."""
    e, n, k = w.shape
    assert a.shape[1] == k and a.stride(1) == 1 and w.stride(2) == 1
    c = torch.empty((n_pairs, n), dtype=out_dtype or a.dtype, device=a.device)
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    a_scale, w_scale, g, span = c, c, 1, k
    if fp8 is not None:
        a_scale, w_scale, group = fp8
        g = w_scale.shape[-1]
        span = k if g == 1 else group
        block_k = max(triton_fp8.MIN_BLOCK_K, min(64, span if g > 1 else
                                                  triton.next_power_of_2(k)))
    grid = (tile_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm[grid](
        a, w, c, pairs, tile_experts, scale if scale is not None else c, a_scale, w_scale,
        n_pairs, n, k, a_row_div, g, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        SCALE=scale is not None, FP8=fp8 is not None, GROUP=max(span, block_k),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return c


def moe(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
        down: torch.Tensor, act, fp8: tuple | None = None) -> torch.Tensor:
    """The MoE MLP of rows ``x`` [T, H] routed to ``experts`` [T, k] with ``weights`` [T, k]
    (``baton.engine.model.route``): gate_up [E, 2I, H], down [E, H, I];
    ``act(gate_up_rows)`` -> act(gate) * up. ``fp8``: (gate_up's scales [E, 2I, G], down's
    [E, H, G'], group) for FP8 experts, each input quantized per row and group. Returns [T, H]
    in x's dtype."""
    t, top_k = experts.shape
    flat = experts.reshape(-1)
    pairs, tiles = align(flat, gate_up.shape[0])
    routed = weights.reshape(-1).contiguous()
    if fp8 is None:
        h = grouped_gemm(x, gate_up, pairs, tiles, flat.shape[0], top_k)  # [T * k, 2I]
        y = grouped_gemm(act(h).contiguous(), down, pairs, tiles, flat.shape[0], 1,
                         scale=routed)  # [T * k, H]
        return y.view(t, top_k, -1).sum(dim=1)
    gate_up_scale, down_scale, group = fp8
    xq, xs = triton_fp8.quantize(x, group)
    h = grouped_gemm(xq, gate_up, pairs, tiles, flat.shape[0], top_k,
                     fp8=(xs, gate_up_scale, group), out_dtype=x.dtype)
    hq, hs = triton_fp8.quantize(act(h).contiguous(), group)
    y = grouped_gemm(hq, down, pairs, tiles, flat.shape[0], 1, scale=routed,
                     fp8=(hs, down_scale, group), out_dtype=x.dtype)
    return y.view(t, top_k, -1).sum(dim=1)
