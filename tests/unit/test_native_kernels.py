"""Native CPU kernels against their torch references on small irregular shapes."""

import pytest
import torch
import torch.nn.functional as F
from baton.kernels import cpu_attention, cpu_linear
from baton.kernels.paged_attention import decode_attention

pytestmark = pytest.mark.skipif(cpu_linear.load() is None, reason="no C compiler")


@pytest.mark.parametrize("m, n, k", [(1, 7, 13), (3, 9, 20), (4, 1, 8), (5, 33, 64),
                                     (16, 100, 37), (2, 576, 576), (1, 37, 64),
                                     (1, 5, 32), (1, 576, 576), (1, 3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_m_linear(m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (n,)))
    w = w.to(dtype)
    for bias in (None, b):
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = cpu_linear.linear(x, w, bias)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_small_m_linear_no_rows():
    assert cpu_linear.linear(torch.empty(0, 8), torch.randn(5, 8)).shape == (0, 5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs, hkv, group, d", [(4, 3, 3, 16), (4, 3, 3, 64), (16, 2, 1, 64),
                                               (8, 1, 4, 64), (4, 2, 2, 64), (4, 1, 5, 64),
                                               (32, 2, 3, 64)])
def test_paged_decode_attention_matches_reference(kv_dtype, bs, hkv, group, d):
    # head_dim 64 with up to 4 query heads per KV head takes the AVX-512 path where the CPU has
    # it, which scores 16 keys at a time: block size 32 has blocks of one and two such groups
    g = torch.Generator().manual_seed(1)
    nb, layers = 23, 2
    kv = torch.randn(nb, layers, 2, bs, hkv, d, generator=g).to(kv_dtype)
    lens = torch.tensor([1, 5, 13, 30])
    perm = torch.randperm(nb, generator=g)
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([perm[i * 2: i * 2 + width] for i in range(4)]) % nb
    q = torch.randn(4, hkv * group, d, generator=g)
    for layer in range(layers):
        want = decode_attention(q, kv, layer, tables, lens, d ** -0.5)
        got = cpu_attention.decode_attention(q, kv, layer, tables, lens, d ** -0.5)
        torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=1e-4)
        # one sequence (a (sequence, head) per thread) and the first two (a sequence per thread)
        for rows in (slice(2, 3), slice(0, 2)):
            got = cpu_attention.decode_attention(q[rows], kv, layer, tables[rows], lens[rows],
                                                 d ** -0.5)
            torch.testing.assert_close(got, want[rows].float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("merged", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,num_past,hq,hkv", [(1, 5, 3, 1), (7, 13, 6, 2), (33, 1, 9, 3),
                                              (16, 40, 4, 4), (5, 0, 6, 3)])
def test_prefill_attention_over_cached_and_new_keys(monkeypatch, merged, dtype, n, num_past, hq,
                                                     hkv):
    # query i (position num_past + i) sees every cached key and the new ones up to itself;
    # merged: two flash calls joined by log-sum-exp, else the masked call (a PyTorch without
    # the flash op that returns the log-sum-exp)
    from baton.kernels import paged_attention
    from baton.kernels.paged_attention import prefill_attention

    if not merged:
        monkeypatch.setattr(paged_attention, "_flash_lse", None)
    elif num_past and paged_attention._flash_lse is None:
        pytest.skip("this PyTorch has no CPU flash attention returning the log-sum-exp")

    g = torch.Generator().manual_seed(n * 100 + num_past)
    q = torch.randn(n, hq, 64, generator=g)
    k, v = (torch.randn(num_past + n, hkv, 64, generator=g) for _ in range(2))
    scale = 0.125
    want = torch.empty(n, hq, 64)
    for i in range(n):
        ks = k[: num_past + i + 1].repeat_interleave(hq // hkv, dim=1)  # [L, hq, D]
        vs = v[: num_past + i + 1].repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[i], ks) * scale, dim=-1)
        want[i] = torch.einsum("hl,lhd->hd", w, vs)
    got = prefill_attention(q.to(dtype), k.to(dtype), v.to(dtype), num_past, scale)
    assert got.dtype == dtype and got.shape == (n, hq, 64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
