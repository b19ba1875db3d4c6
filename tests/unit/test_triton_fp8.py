"""The FP8 matmul kernels (dense and grouped-expert) against their torch reference.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton
is imported), on irregular shapes: K not a multiple of the group, partial tiles, odd expert
counts. The reference quantizes the activations the same way and multiplies the dequantized
operands in float32, so the two agree to float32 rounding; the product itself is checked against
the unquantized one to FP8's precision.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from baton.engine import fp8 as checkpoint_fp8  # noqa: E402
from baton.kernels import triton_fp8 as f  # noqa: E402

from tests.support.kernels import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantized_weight(n: int, k: int, group: int, gen: torch.Generator, dim0: int = 0):
    """(FP8 [*, n, k], scales [*, n, G], the float32 weight) quantized per row and group."""
    w = torch.randn(*((dim0,) if dim0 else ()), n, k, generator=gen) * 0.3
    g = checkpoint_fp8.groups(k, group)
    cols = torch.arange(k) // (k if g == 1 else group)
    flat = w.reshape(-1, k)
    s = torch.zeros(flat.shape[0], g).scatter_reduce_(
        1, cols.expand(flat.shape[0], k), flat.abs(), "amax") / f.FP8_MAX
    q = (flat / s[:, cols]).to(f.FP8)
    return q.reshape(w.shape), s.reshape(*w.shape[:-1], g), w


@pytest.mark.parametrize("m, n, k, group", [
    (1, 40, 96, 0),       # one decode row, per-row scales
    (5, 37, 70, 0),       # nothing a multiple of 16
    (3, 72, 200, 64),     # K 200 in groups of 64: a partial last group
    (33, 130, 256, 128),  # a prefill tile and a partial one, the official 128-column blocks
    (4, 24, 48, 32),
])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_matmul_matches_the_reference(m, n, k, group, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    wq, ws, w = quantized_weight(n, k, group, gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = f.reference(x, wq, ws, group, b)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, wq, ws, b)]
    got = f.matmul(*dev[:3], group, dev[3]).cpu()
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    exact = x @ w.T + (b if bias else 0)
    assert rel_err(got, exact) < 0.06  # e4m3: 3 mantissa bits on each side


def test_activation_quantization_rounds_like_torch():
    # the kernel's float32 -> FP8 conversion is torch's, to the value (values just below a
    # power of two round up into the next binade: the interpreter's own conversion does not)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 300, generator=gen) * 40
    for group in (0, 64):
        q, s = f.quantize(x.to(DEVICE), group)
        span = 300 if group == 0 else group
        cols = torch.arange(300) // span
        s_want = torch.stack([x[:, cols == c].abs().amax(1) for c in cols.unique()], 1) / 448
        assert torch.equal(s.cpu(), s_want)
        assert torch.equal(q.cpu().float(), (x / s_want[:, cols]).to(f.FP8).float())


def test_scaled_mm_call_matches_the_reference():
    # torch._scaled_mm (which runs on CPU too) with the scales as Baton passes them on a GPU
    gen = torch.Generator().manual_seed(2)
    wq, ws, _ = quantized_weight(48, 64, 0, gen)
    x = torch.randn(6, 64, generator=gen)
    xq, xs = f.quantize(x.to(DEVICE), 0)
    got = f.scaled_mm(xq.cpu(), xs.cpu(), wq, ws, torch.float32)
    assert rel_err(got, f.reference(x, wq, ws, 0)) < 1e-5


@pytest.mark.parametrize("strategy, block", [("block", (32, 64)), ("block", (128, 128)),
                                             ("channel", None), ("tensor", None)])
def test_checkpoint_scales_expand_to_the_dequantized_weight(strategy, block):
    # every checkpoint layout as per-row group scales: the same values as the loader's
    # dequantization on CPU
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 150
    q = (torch.randn(n, k, generator=gen) * 50).to(f.FP8)
    grid = (-(-n // block[0]), -(-k // block[1])) if block else (n, 1) if strategy == "channel" \
        else (1,)
    scale = torch.rand(grid, generator=gen) + 0.1
    s = checkpoint_fp8.Fp8Scheme("x", strategy, block)
    rows = checkpoint_fp8.expand_scale(scale, n, k, block)
    cols = torch.arange(k) // (block[1] if block else k)
    assert torch.equal(q.float() * rows[:, cols], checkpoint_fp8.dequantize(q, scale, s))
    group = block[1] if block else 0
    assert torch.equal(checkpoint_fp8.dequantize_rows(q, rows, group),
                       checkpoint_fp8.dequantize(q, scale, s))


@pytest.mark.parametrize("t, e, top_k, h, i, group", [
    (1, 9, 2, 48, 40, 0),      # a decode row, per-row scales
    (37, 11, 3, 64, 48, 32),   # a prefill chunk, an odd expert count, column groups
    (6, 5, 1, 80, 24, 32),     # top-1, hidden not a multiple of the group
])
def test_fp8_grouped_expert_moe_matches_the_reference(t, e, top_k, h, i, group):
    from baton.engine.model import gate_mul
    from baton.kernels import triton_moe

    gen = torch.Generator().manual_seed(t + e + h)
    gu_q, gu_s, _ = quantized_weight(2 * i, h, group, gen, dim0=e)
    dn_q, dn_s, _ = quantized_weight(h, i, group, gen, dim0=e)
    x = torch.randn(t, h, generator=gen)
    experts = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=gen)
    want = torch.zeros(t, h)
    for row in range(t):  # one (token, expert) pair at a time
        for slot in range(top_k):
            ex = int(experts[row, slot])
            act = gate_mul(f.reference(x[row:row + 1], gu_q[ex], gu_s[ex], group), "silu")
            want[row] += weights[row, slot] * f.reference(act, dn_q[ex], dn_s[ex], group)[0]
    dev = [v.to(DEVICE) for v in (x, weights, experts, gu_q, dn_q, gu_s, dn_s)]
    got = triton_moe.moe(*dev[:5], lambda g: gate_mul(g, "silu"), fp8=(*dev[5:], group)).cpu()
    assert got.dtype == x.dtype
    assert rel_err(got, want) < 1e-4, rel_err(got, want)


def test_the_loaders_narrowest_block_is_the_kernels_narrowest_tile():
    from baton.engine.loader import FP8_MIN_GROUP

    assert FP8_MIN_GROUP == f.MIN_BLOCK_K == 32
