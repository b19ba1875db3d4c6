"""Triton kernels against their torch references, on irregular shapes.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set
here before Triton is imported) on CPU tensors: slow, so shapes are small, but every index and
mask is the one the GPU runs. Tests marked ``gpu`` run the same comparisons on CUDA, bf16 too.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from baton.engine.model import apply_rope, rms_norm  # noqa: E402
from baton.kernels import paged_attention as ref  # noqa: E402
from baton.kernels import triton_attention as tri  # noqa: E402
from baton.kernels import triton_fused as fused  # noqa: E402

from tests.support.kernels import rel_err  # noqa: E402

DEVICES = ["cpu"] if not torch.cuda.is_available() else ["cuda"]


def make_cache(num_blocks, layers, bs, hkv, d, dtype, device, gen):
    return torch.randn((num_blocks, layers, 2, bs, hkv, d), generator=gen).to(dtype).to(device)


def random_tables(lens, bs, num_blocks, gen, device):
    """Distinct shuffled blocks per sequence, padded with a valid id (the reference's contract)."""
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(num_blocks, generator=gen)
    rows, used = [], 0
    for n in lens:
        k = -(-n // bs)
        rows.append(perm[used:used + k].tolist() + [int(perm[0])] * (width - k))
        used += k
    return torch.tensor(rows, dtype=torch.int32, device=device)


TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "hq,hkv,d,bs,lens,splits",
    [
        (9, 3, 64, 16, [1, 17, 16, 33], 1),      # SmolLM2 heads; context 1; block boundaries
        (9, 3, 64, 16, [1, 17, 16, 130], 3),     # split context, a split left empty for ctx 1
        (4, 4, 32, 8, [5, 64, 65], 4),           # MHA, partial last blocks
        (6, 2, 48, 4, [7, 100], 2),              # head dim not a power of two
        (8, 1, 64, 32, [200], 7),                 # MQA, one sequence, many splits
    ],
)
@pytest.mark.parametrize("window", [0, 13])  # 13: a sliding window shorter than most contexts
def test_decode_attention_matches_reference(device, hq, hkv, d, bs, lens, splits, window):
    gen = torch.Generator().manual_seed(hash((hq, d, bs, splits)) % 1000)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        nblocks = sum(-(-n // bs) for n in lens) + 3
        kv = make_cache(nblocks, 2, bs, hkv, d, dtype, device, gen)
        q = torch.randn((len(lens), hq, d), generator=gen).to(dtype).to(device)
        tables = random_tables(lens, bs, nblocks, gen, device)
        ctx = torch.tensor(lens, dtype=torch.int32, device=device)
        want = ref.decode_attention(q.cpu().float(), kv.cpu().float(), 1, tables.cpu().long(),
                                    ctx.cpu().long(), d**-0.5, window)
        out = torch.full_like(q, float("nan"))
        got = tri.decode_attention(q, kv, 1, tables, ctx, d**-0.5, num_splits=splits, out=out,
                                   window=window)
        assert not got.isnan().any(), "an output element was never written"
        assert rel_err(got.cpu(), want) < TOL[dtype], (dtype, rel_err(got.cpu(), want))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_padding_rows_are_zero(device):
    """A CUDA-graph batch pads with rows of context 0: their output is zeros, not NaN."""
    gen = torch.Generator().manual_seed(3)
    kv = make_cache(6, 1, 16, 2, 32, torch.float32, device, gen)
    q = torch.randn((3, 4, 32), generator=gen).to(device)
    tables = torch.tensor([[0, 1], [2, 0], [0, 0]], dtype=torch.int32, device=device)
    ctx = torch.tensor([20, 3, 0], dtype=torch.int32, device=device)
    for splits in (1, 3):
        got = tri.decode_attention(q, kv, 0, tables, ctx, 0.2, num_splits=splits)
        assert torch.equal(got[2], torch.zeros_like(got[2]))
        want = ref.decode_attention(q[:2].cpu(), kv.cpu(), 0, tables[:2].cpu().long(),
                                    ctx[:2].cpu().long(), 0.2)
        assert rel_err(got[:2].cpu(), want) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "hq,hkv,d,bs,chunks",
    [
        (9, 3, 64, 16, [(0, 37), (16, 1), (5, 70)]),   # (num_past, new tokens) per sequence
        (4, 2, 32, 8, [(64, 33), (0, 1)]),
        (6, 6, 48, 4, [(3, 9)]),
    ],
)
@pytest.mark.parametrize("window", [0, 20])  # 20: a tile's rows start their windows apart
def test_prefill_attention_matches_reference(device, hq, hkv, d, bs, chunks, window):
    gen = torch.Generator().manual_seed(len(chunks) * 7 + d)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        lens = [p + n for p, n in chunks]
        nblocks = sum(-(-n // bs) for n in lens) + 2
        kv = make_cache(nblocks, 3, bs, hkv, d, dtype, device, gen)
        tables = random_tables(lens, bs, nblocks, gen, device)
        total = sum(n for _, n in chunks) + 2  # two rows that belong to no sequence
        q = torch.randn((total, hq, d), generator=gen).to(dtype).to(device)
        starts, row = [], 1
        for _, n in chunks:
            starts.append(row)
            row += n
        out = torch.full_like(q, float("nan"))
        tri.prefill_attention(
            q, kv, 2, tables, torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor([n for _, n in chunks], dtype=torch.int32, device=device),
            torch.tensor([p for p, _ in chunks], dtype=torch.int32, device=device),
            max(n for _, n in chunks), d**-0.5, out=out, window=window)
        for (past, n), s, table in zip(chunks, starts, tables.cpu().long()):
            k, v = ref.gather_kv(kv.cpu().float(), 2, table, torch.float32)
            want = ref.prefill_attention(q[s:s + n].cpu().float(), k[:past + n], v[:past + n],
                                         past, d**-0.5, window)
            got = out[s:s + n].cpu()
            assert not got.isnan().any()
            assert rel_err(got, want) < TOL[dtype], (dtype, past, n, rel_err(got, want))
        assert out[0].isnan().all() and out[-1].isnan().all(), "wrote rows of no sequence"


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_matches_reference_and_skips_padding(device):
    gen = torch.Generator().manual_seed(5)
    kv = make_cache(5, 2, 8, 3, 40, torch.float32, device, gen)
    want = kv.cpu().clone()
    k = torch.randn((4, 3, 40), generator=gen).to(device)
    v = torch.randn((4, 3, 40), generator=gen).to(device)
    blocks = torch.tensor([4, 0, -1, 2], device=device)
    offs = torch.tensor([7, 0, 3, 5], device=device)
    tri.store_kv(kv, 1, blocks, offs, k, v)
    keep = blocks.cpu() >= 0
    ref.store_kv(want, 1, blocks.cpu()[keep], offs.cpu()[keep], k.cpu()[keep], v.cpu()[keep])
    assert torch.equal(kv.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_reference(device, with_delta):
    gen = torch.Generator().manual_seed(11)
    h = torch.randn((5, 72), generator=gen).to(device)
    delta = torch.randn((5, 72), generator=gen).to(device) if with_delta else None
    w = torch.randn(72, generator=gen).to(device)
    want_h = h.cpu() + (delta.cpu() if with_delta else 0)
    want = rms_norm(want_h, w.cpu(), 1e-5)
    got = fused.add_rms_norm(h, delta, w, 1e-5)
    assert rel_err(got.cpu(), want) < 1e-6
    assert torch.allclose(h.cpu(), want_h)  # the residual is updated in place


@pytest.mark.parametrize("device", DEVICES)
def test_rope_store_kv_matches_reference(device):
    gen = torch.Generator().manual_seed(13)
    hq, hkv, d, bs, t = 6, 2, 24, 4, 7
    qkv = torch.randn((t, (hq + 2 * hkv) * d), generator=gen).to(device)
    pos = torch.tensor([0, 1, 2, 9, 30, 31, 5], device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(64).float()[:, None] * inv[None, :]
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    kv = make_cache(6, 2, bs, hkv, d, torch.float32, device, gen)
    want_kv = kv.cpu().clone()
    blocks = torch.tensor([0, 0, 1, 5, -1, 3, 2], device=device)
    offs = torch.tensor([0, 1, 2, 3, 0, 1, 2], device=device)
    q = fused.rope_store_kv(qkv, pos, cos, sin, kv, 1, blocks, offs, hq)

    c, s = cos.cpu()[pos.cpu()].unsqueeze(1), sin.cpu()[pos.cpu()].unsqueeze(1)
    qk = apply_rope(qkv.cpu()[:, :(hq + hkv) * d].view(t, hq + hkv, d), c, s)
    assert rel_err(q.cpu(), qk[:, :hq]) < 1e-6
    keep = blocks.cpu() >= 0
    vv = qkv.cpu()[:, (hq + hkv) * d:].view(t, hkv, d)
    ref.store_kv(want_kv, 1, blocks.cpu()[keep], offs.cpu()[keep], qk[:, hq:][keep], vv[keep])
    assert rel_err(kv.cpu(), want_kv) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_matches_reference(device):
    gen = torch.Generator().manual_seed(17)
    x = torch.randn((3, 2 * 1100), generator=gen).to(device)  # crosses a 1024-column tile
    gate, up = x.cpu().chunk(2, dim=-1)
    assert rel_err(fused.silu_mul(x).cpu(), torch.nn.functional.silu(gate) * up) < 1e-6


def test_decode_splits_fill_the_device_without_empty_tiles():
    split = functools.partial(tri.decode_splits, block_n=64, waves=2)
    assert split(1, 8, 1024, 132) == 16  # capped by 1024 / 64 tiles
    assert split(1, 8, 32768, 132) == 33  # 2 x 132 programs
    assert split(1, 1, 1 << 20, 132) == 64  # at most 64 pieces to merge
    assert split(128, 8, 1024, 132) == 1
    assert split(4, 3, 10, 132) == 1
    assert tri.decode_splits(1, 8, 32768, 132, block_n=32, waves=4) == 64  # 66 wanted, capped
    # the launcher's own rule: a batch with a program per multiprocessor is not split
    assert tri.decode_splits(32, 8, 32768, 132) == 1
    assert tri.decode_splits(8, 8, 8192, 132) == tri.decode_splits(
        8, 8, 8192, 132, *tri.DECODE_SPLIT_LAUNCH[::3]) > 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t, e, k, h, i, norm", [
    (1, 9, 2, 48, 40, True),      # one decode row: most experts idle
    (7, 9, 2, 48, 40, False),     # a few rows, unnormalised weights (Qwen3-MoE)
    (37, 11, 3, 40, 24, True),    # a prefill chunk: tiles of several rows, an odd expert count
    (5, 4, 1, 32, 56, True),      # top-1
])
def test_grouped_expert_moe_matches_the_torch_reference(device, t, e, k, h, i, norm):
    # one launch per projection for all experts, pairs sorted and padded per expert on the
    # device, against the CPU engine's loop over expert hits
    from types import SimpleNamespace

    from baton.engine.config import ModelConfig
    from baton.engine.model import gate_mul, moe, route
    from baton.kernels import triton_moe

    gen = torch.Generator().manual_seed(t * 100 + e)
    x = torch.randn(t, h, generator=gen)
    router = torch.randn(e, h, generator=gen)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * 0.2
    down = torch.randn(e, h, i, generator=gen) * 0.2
    cfg = ModelConfig(arch="mixtral", vocab_size=10, hidden_size=h, intermediate_size=i,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=h, max_position=8,
                      moe_layers=(0,), num_experts=e, experts_per_token=k,
                      moe_intermediate_size=i, norm_topk_prob=norm)
    layer = SimpleNamespace(router=router, experts_gate_up=gate_up, experts_down=down)
    want = moe(x, layer, cfg)
    weights, experts = route(x, router, cfg)
    got = triton_moe.moe(*(v.to(device) for v in (x, weights, experts, gate_up, down)),
                         lambda g: gate_mul(g, "silu"))
    assert got.shape == want.shape
    assert rel_err(got.cpu(), want) < 1e-5, rel_err(got.cpu(), want)
    pairs, tiles = triton_moe.align(torch.tensor([2, 0, 2, 2, 1]), 3, block_m=2)
    assert tiles.tolist() == [0, 1, 2, 2, -1, -1]  # ceil(5 / 2) + 3 tiles at most
    assert pairs.tolist()[:8] == [1, 5, 4, 5, 0, 2, 3, 5]
