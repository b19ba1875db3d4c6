"""Triton kernels for the engine on CUDA: paged decode and prefill attention, and the KV store.

They read and write Baton's block-major KV cache in place (docs/engine.md, "KV layout")::

    kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

A layer's keys ``kv[:, layer, 0]`` are a strided view ``[num_blocks, block_size, H, D]``: within a
block, one token's heads are contiguous, so a tile of ``BLOCK_N`` keys for one head is
``BLOCK_N`` rows of ``D`` contiguous elements gathered through the block table.

Each launcher asserts shapes, strides and dtypes, reads no tensor value on the host (so decode
can be captured in a CUDA graph), and has a torch reference in ``paged_attention.py``; the
tests compare the two on irregular shapes under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn


def _check_kv(kv: torch.Tensor, layer: int) -> tuple[int, int, int]:
    assert kv.dim() == 6 and kv.shape[2] == 2, f"kv must be [N, L, 2, bs, H, D], got {kv.shape}"
    assert kv.stride(5) == 1, "kv's head dim must be contiguous (any layout, engine/kv_layout.py)"
    assert 0 <= layer < kv.shape[1], f"layer {layer} out of range for {kv.shape[1]} layers"
    _, _, _, bs, h, d = kv.shape
    assert bs & (bs - 1) == 0, f"block size {bs} must be a power of two"
    return bs, h, d


def _layer_scales(kv: torch.Tensor, kv_scales: torch.Tensor | None, layer: int,
                  dummy: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """(whether ``kv`` is an FP8 cache, its layer's scales [2] or any tensor if not)."""
    if kv.dtype != FP8:
        return False, dummy
    assert kv_scales is not None and kv_scales.dtype == torch.float32, "FP8 KV needs its scales"
    return True, kv_scales[layer]


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 stays float32 (no TF32): the engine's float32 mode must match the CPU engine's tokens
    return "ieee" if dtype == torch.float32 else "tf32"


# =================================================================================================
# KV store
# =================================================================================================


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, blk_ptr, off_ptr,
    stride_kt, stride_vt, stride_cb, stride_co,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    blk = tl.load(blk_ptr + t).to(tl.int64)
    if blk >= 0:  # a negative block id marks a padding row (CUDA-graph batches): nothing to store
        off = tl.load(off_ptr + t).to(tl.int64)
        cols = tl.arange(0, ROW_PAD)
        m = cols < ROW
        dst = blk * stride_cb + off * stride_co + cols
        k = tl.load(k_ptr + t * stride_kt + cols, mask=m)
        v = tl.load(v_ptr + t * stride_vt + cols, mask=m)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)


def store_kv(
    kv: torch.Tensor, layer: int, block_ids: torch.Tensor, offsets: torch.Tensor,
    k: torch.Tensor, v: torch.Tensor,
) -> None:
    """Write new keys/values into their slots. k, v: [T, H, D] (each token's heads contiguous);
    block_ids, offsets: [T] (block id < 0: skip the row)."""
    _, h, d = _check_kv(kv, layer)
    t = k.shape[0]
    assert k.shape == v.shape == (t, h, d), f"k/v {tuple(k.shape)} vs cache heads {(h, d)}"
    assert k.stride(2) == 1 and k.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d
    assert block_ids.shape == offsets.shape == (t,)
    if t == 0:
        return
    kc, vc = kv[:, layer, 0], kv[:, layer, 1]
    _store_kv_kernel[(t,)](
        k, v, kc, vc, block_ids, offsets, k.stride(0), v.stride(0), kc.stride(0), kc.stride(1),
        ROW=h * d, ROW_PAD=triton.next_power_of_2(h * d), num_warps=4,
    )


# =================================================================================================
# Decode attention: one query token per sequence, the context split into NUM_SPLITS pieces
# =================================================================================================


@triton.jit
def _load_kv_tile(
    kc_ptr, vc_ptr, bt_row, offs_n, valid, offs_d, dmask, kvh, stride_cb, stride_ct, stride_ch,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DT: tl.constexpr,
):
    """Keys and values [BLOCK_N, D_PAD] of KV head ``kvh`` at sequence positions ``offs_n``,
    gathered through the sequence's block table ``bt_row`` (invalid rows: zeros), in the
    queries' dtype ``DT`` (an FP8 cache's values unscaled: the callers fold the scales in)."""
    blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = blk * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kvh * stride_ch
    if HEAD_DIM == D_PAD:  # a row mask only: the loads stay 16 bytes wide along D
        kvmask = tl.broadcast_to(valid[:, None], (BLOCK_N, D_PAD))
    else:
        kvmask = valid[:, None] & dmask[None, :]
    k = tl.load(kc_ptr + rows[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
    v = tl.load(vc_ptr + rows[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
    return k.to(DT), v.to(DT)


@triton.jit
def _kv_scales(kvs_ptr, KV_FP8: tl.constexpr):
    """(key scale, value scale) of an FP8 cache's layer; 1 for any other cache."""
    if KV_FP8:
        return tl.load(kvs_ptr), tl.load(kvs_ptr + 1)
    return 1.0, 1.0


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, pacc_ptr, pml_ptr, kvs_ptr,
    scale, num_splits, window,
    stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Program (b, kv head, split): the GROUP query heads sharing one KV head, over one split of
    the sequence's keys. With DIRECT (one split) it writes the output; otherwise the partial
    accumulator with its running max and sum, which ``_reduce_kernel`` merges. ``window`` > 0:
    only the sequence's last ``window`` keys are split and read (a sliding-window layer)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the first key it sees
    per = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, ctx)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    gmask, dmask = offs_g < GROUP, offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    k_scale, v_scale = _kv_scales(kvs_ptr, KV_FP8)
    q = _load_rows(q_ptr + b * stride_qb + heads[:, None] * stride_qh, offs_d,
                   gmask[:, None] & dmask[None, :], scale * k_scale)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        k, v = _load_kv_tile(kc_ptr, vc_ptr, bt_row, offs_n, valid, offs_d, dmask, kvh,
                             stride_cb, stride_ct, stride_ch, HEAD_DIM, D_PAD, BLOCK_SIZE,
                             BLOCK_N, q_ptr.dtype.element_ty)
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k, v, valid, PRECISION)
    # partials: pacc [B, Hq, S, D_PAD] and pml [B, Hq, S, 2] (max, sum), float32
    base = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
    _store_out(acc * v_scale, l_i, m_i, out_ptr + b * stride_ob + heads[:, None] * stride_oh,
                  pacc_ptr + base[:, None] * D_PAD, pml_ptr + base * 2, offs_d,
                  gmask[:, None] & dmask[None, :], gmask, DIRECT)


@triton.jit
def _decode_tile(acc, l_i, m_i, q, k, v, valid, PRECISION: tl.constexpr):
    """One tile of keys through the online softmax: the new (acc, l_i, m_i)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [GROUP_PAD, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    return _online_softmax(acc, l_i, m_i, s, v, PRECISION, False)


@triton.jit
def _online_softmax(acc, l_i, m_i, s, v, PRECISION: tl.constexpr, BASE2: tl.constexpr):
    """One tile's scores ``s`` (keys not seen: -inf) and values ``v`` into the running softmax:
    the new (acc, l_i, m_i). BASE2: the scores carry log2(e), so exp2 stands for exp."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet (all -inf: a tile before its sliding window) subtracts 0,
    # not -inf: its p and alpha are then 0, not NaN
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    if BASE2:
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
    else:
        alpha = tl.exp(m_i - m_sub)
        p = tl.exp(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _store_out(acc, l_i, m_i, out_rows, pacc_rows, pml_at, offs_d, omask, gmask,
                  DIRECT: tl.constexpr):
    """With DIRECT the normalized output at ``out_rows`` (pointers to each row's start);
    otherwise (split decode) the partial accumulator at ``pacc_rows`` and its running (max, sum)
    at ``pml_at``."""
    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_rows + offs_d[None, :], out.to(out_rows.dtype.element_ty), mask=omask)
    else:
        tl.store(pacc_rows + offs_d[None, :], acc, mask=omask)
        tl.store(pml_at, m_i, mask=gmask)
        tl.store(pml_at + 1, l_i, mask=gmask)


@triton.jit
def _reduce_kernel(
    pacc_ptr, pml_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    smask = offs_s < num_splits
    base = (b * num_heads + h) * num_splits + offs_s
    m = tl.load(pml_ptr + base * 2, mask=smask, other=float("-inf"))
    l_s = tl.load(pml_ptr + base * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # an empty row (context 0): zeros out
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    acc = tl.load(pacc_ptr + base[:, None] * D_PAD + offs_d[None, :], mask=smask[:, None],
                  other=0.0)
    denom = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# The decode kernel's launch settings, (BLOCK_N, num_warps, num_stages, waves), from bench/gpu.py
# --sweep-attention on an H100 (Llama-3-8B heads, bf16). A batch with fewer (sequence, KV head)
# programs than the device has multiprocessors splits each context so that ``waves`` times as
# many programs run, over short tiles; a larger batch runs one program per (sequence, KV head)
# over long tiles, and needs no merge.
DECODE_SPLIT_LAUNCH = (32, 4, 2, 4)
DECODE_WHOLE_LAUNCH = (128, 4, 3, 1)


def decode_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int,
                  block_n: int | None = None, waves: int | None = None) -> int:
    """How many pieces to split each sequence's context into so that ``batch * num_kv_heads *
    splits`` programs fill the device ``waves`` times over, without a piece shorter than one
    tile and with at most 64 pieces to merge. Without ``waves``, the rule above."""
    if waves is None:
        if batch * num_kv_heads >= num_sms:
            return 1
        block_n, waves = block_n or DECODE_SPLIT_LAUNCH[0], DECODE_SPLIT_LAUNCH[3]
    block_n = block_n or DECODE_SPLIT_LAUNCH[0]
    want = triton.cdiv(waves * num_sms, max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max(1, max_context), block_n), 64))


def _check_decode_args(q, kv, layer, block_tables, context_lens, num_splits):
    """(block size, KV heads, head dim) of ``kv``, after checking what decode_attention gets."""
    bs, hkv, d = _check_kv(kv, layer)
    b, hq, dq = q.shape
    assert dq == d and hq % hkv == 0, f"q {tuple(q.shape)} does not fit {hkv} KV heads of dim {d}"
    assert q.stride(2) == 1, "q's head dim must be contiguous"
    assert q.dtype == kv.dtype or kv.dtype == FP8, f"q is {q.dtype}, the KV cache {kv.dtype}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == b and block_tables.stride(1) == 1
    assert context_lens.shape == (b,)
    assert num_splits >= 1
    return bs, hkv, d


def decode_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, num_splits: int = 1, out: torch.Tensor | None = None,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    window: int = 0, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention. q: [B, Hq, D]; block_tables: [B, max_blocks] (int32/int64,
    entries past a sequence's blocks may be anything valid); context_lens: [B] (keys per sequence
    including the query's own; 0 for a padding row, whose output is zeros). Returns [B, Hq, D].
    ``num_splits`` (see :func:`decode_splits`) is fixed by the caller, never read off the data.
    ``window`` > 0: each query sees its sequence's last ``window`` keys only. An FP8 cache
    (``kv_scales`` [L, 2], float32) holds keys and values divided by its layer's scales."""
    bs, hkv, d = _check_decode_args(q, kv, layer, block_tables, context_lens, num_splits)
    b, hq, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if b == 0:
        return out
    group = hq // hkv
    kc, vc = kv[:, layer, 0], kv[:, layer, 1]
    d_pad = triton.next_power_of_2(d)
    direct = num_splits == 1
    launch = DECODE_WHOLE_LAUNCH if direct else DECODE_SPLIT_LAUNCH
    if direct:
        pacc = pml = out  # unused
    else:
        pacc = torch.empty((b, hq, num_splits, d_pad), dtype=torch.float32, device=q.device)
        pml = torch.empty((b, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    fp8, kvs = _layer_scales(kv, kv_scales, layer, out)
    _decode_kernel[(b, hkv, num_splits)](
        q, kc, vc, block_tables, context_lens, out, pacc, pml, kvs, scale, num_splits, window,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_SIZE=bs, BLOCK_N=block_n or launch[0], DIRECT=direct,
        PRECISION=_dot_precision(q.dtype), KV_FP8=fp8, num_warps=num_warps or launch[1],
        num_stages=num_stages or launch[2],
    )
    if not direct:
        _reduce_kernel[(b, hq)](
            pacc, pml, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=d, D_PAD=d_pad, S_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return out


# =================================================================================================
# Prefill attention: chunks of new queries over cached + new keys, causal, several sequences
# =================================================================================================


@triton.jit
def _prefill_tile(
    acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row, n0, last, pos, offs_d, dmask, kvh,
    stride_cb, stride_ct, stride_ch, window,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """One tile of keys [n0, n0 + BLOCK_N) into the running softmax (base 2: q carries log2 e).
    MASKED: the causal edge, the tail past ``last`` and (``window`` > 0) the keys before each
    row's sliding window; otherwise every key is visible."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    valid = offs_n < last
    k, v = _load_kv_tile(kc_ptr, vc_ptr, bt_row, offs_n, valid, offs_d, dmask, kvh,
                         stride_cb, stride_ct, stride_ch, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N,
                         q.dtype)
    sc = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        seen = (offs_n[None, :] <= pos[:, None]) & valid[None, :]
        if window > 0:
            seen = seen & (offs_n[None, :] > pos[:, None] - window)
        sc = tl.where(seen, sc, float("-inf"))
    return _online_softmax(acc, l_i, m_i, sc, v, PRECISION, True)


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, qstart_ptr, qlen_ptr, past_ptr, out_ptr, kvs_ptr, scale,
    window, stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_btb, stride_ot,
    stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Program (query tile, sequence, query head). Query i of a sequence sits at position
    ``num_past + i`` and sees keys ``0 .. num_past + i``, all read from the paged cache (the new
    keys were stored before the call). Keys wholly before the tile's first query take a loop
    without masks; the causal edge a second, masked one. With ``window`` > 0 (a sliding-window
    layer) the tile reads only keys from its first row's window on, all through the masked
    loop. The last tiles (the most keys) start first."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    s, h = tl.program_id(1), tl.program_id(2)
    q_len = tl.load(qlen_ptr + s)
    if tile * BLOCK_M < q_len:
        q0, past = tl.load(qstart_ptr + s), tl.load(past_ptr + s)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        mmask, dmask = offs_m < q_len, offs_d < HEAD_DIM
        rmask = mmask[:, None] & dmask[None, :]
        k_scale, v_scale = _kv_scales(kvs_ptr, KV_FP8)
        q = _load_rows(q_ptr + (q0 + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh,
                       offs_d, rmask, scale * k_scale * 1.4426950408889634)
        pos = past + offs_m  # each query's position
        last = past + tl.minimum((tile + 1) * BLOCK_M, q_len)  # keys [0, last) matter to the tile
        first, full = _prefill_span(past + tile * BLOCK_M, window, BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        bt_row = bt_ptr + s * stride_btb
        for n0 in range(first, full, BLOCK_N):
            acc, l_i, m_i = _prefill_tile(
                acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row, n0, last, pos, offs_d, dmask, h // GROUP,
                stride_cb, stride_ct, stride_ch, window, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N,
                False, PRECISION)
        for n0 in range(full, last, BLOCK_N):
            acc, l_i, m_i = _prefill_tile(
                acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row, n0, last, pos, offs_d, dmask, h // GROUP,
                stride_cb, stride_ct, stride_ch, window, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N,
                True, PRECISION)
        _store_out(acc * v_scale, l_i, m_i,
                      out_ptr + (q0 + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh,
                      out_ptr, out_ptr, offs_d, rmask, mmask, True)


@triton.jit
def _prefill_span(pos0, window, BLOCK_N: tl.constexpr):
    """(first, full) for a tile whose first query sits at ``pos0``: keys before ``first`` are
    seen by no row (a sliding window's start, rounded down to a tile of keys), keys in
    [first, full) by every row (none with a window: all go through the masked loop)."""
    full = pos0 // BLOCK_N * BLOCK_N
    first = full * 0
    if window > 0:
        first = tl.maximum(pos0 - window + 1, 0) // BLOCK_N * BLOCK_N
        full = first
    return first, full


@triton.jit
def _load_rows(rows, offs_d, mask, scale):
    """Query rows at ``rows`` (pointers to each row's start), scaled, in their own dtype."""
    q = tl.load(rows + offs_d[None, :], mask=mask, other=0.0)
    return (q.to(tl.float32) * scale).to(q.dtype)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel for 16-bit dtypes, from
# bench/gpu.py --sweep-attention on an H100 (Llama-3-8B heads, 2k and 8k tokens); float32 tiles
# take four times the shared memory of these (PREFILL_LAUNCH_F32)
PREFILL_LAUNCH = (128, 128, 8, 3)
PREFILL_LAUNCH_F32 = (32, 64, 4, 2)


def prefill_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: int, block_tables: torch.Tensor,
    q_starts: torch.Tensor, q_lens: torch.Tensor, num_past: torch.Tensor, max_q_len: int,
    scale: float, out: torch.Tensor | None = None,
    launch: tuple[int, int, int, int] | None = None, window: int = 0,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of several sequences' new query chunks over their cached and new keys.

    q: [T, Hq, D] (the batch's rows); sequence s owns rows ``q_starts[s] .. + q_lens[s]`` and has
    ``num_past[s]`` keys cached before them; block_tables: [S, max_blocks] covering ``num_past +
    q_len`` keys, the new ones already stored. ``max_q_len`` (host int) sizes the grid. Rows of
    ``out`` that belong to no sequence are left as they were. ``window`` > 0: query i sees only
    keys ``num_past + i - window + 1 ..`` (a sliding-window layer). An FP8 cache
    (``kv_scales`` [L, 2], float32) holds keys and values divided by its layer's scales."""
    bs, hkv, d = _check_kv(kv, layer)
    t, hq, dq = q.shape
    assert dq == d and hq % hkv == 0, f"q {tuple(q.shape)} does not fit {hkv} KV heads of dim {d}"
    assert q.stride(2) == 1 and (q.dtype == kv.dtype or kv.dtype == FP8), \
        f"q must be {kv.dtype} with contiguous heads"
    n = q_starts.shape[0]
    assert q_lens.shape == num_past.shape == (n,) and block_tables.shape[0] == n
    assert block_tables.stride(1) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if n == 0 or max_q_len == 0:
        return out
    kc, vc = kv[:, layer, 0], kv[:, layer, 1]
    d_pad = triton.next_power_of_2(d)
    default = PREFILL_LAUNCH_F32 if q.dtype == torch.float32 else PREFILL_LAUNCH
    block_m, block_n, warps, stages = launch or default
    grid = (triton.cdiv(max_q_len, block_m), n, hq)
    fp8, kvs = _layer_scales(kv, kv_scales, layer, out)
    _prefill_kernel[grid](
        q, kc, vc, block_tables, q_starts, q_lens, num_past, out, kvs, scale, window,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=bs, BLOCK_M=block_m,
        BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype), KV_FP8=fp8, num_warps=warps,
        num_stages=stages,
    )
    return out
