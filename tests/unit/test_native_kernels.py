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


def _causal_reference(q, k, v, num_past: int, scale: float) -> torch.Tensor:
    """The torch reference (checked against a per-query loop above) in float64."""
    from baton.kernels.paged_attention import prefill_attention

    return prefill_attention(q.double(), k.double(), v.double(), num_past, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, num_past, hkv, group, d", [
    (1, 0, 1, 1, 64), (5, 3, 3, 3, 64), (13, 0, 2, 5, 64), (37, 70, 3, 3, 64),
    (100, 0, 2, 4, 128), (13, 200, 1, 7, 128), (67, 31, 3, 3, 64), (32, 32, 4, 1, 64)])
def test_native_prefill_attention_matches_float64(dtype, n, num_past, hkv, group, d):
    # tiles of 12 rows (query x head of a group) over 32-key blocks: the shapes leave partial
    # tiles, partial blocks, tiles whose queries straddle a block edge, and cached keys
    if not cpu_attention.prefill_supported(dtype, d):
        pytest.skip(f"this CPU cannot run the native prefill kernel for {dtype}")
    g = torch.Generator().manual_seed(n * 1000 + num_past + d)
    q = torch.randn(n, hkv * group, d, generator=g).to(dtype)
    k, v = (torch.randn(num_past + n, hkv, d, generator=g).to(dtype) for _ in range(2))
    want = _causal_reference(q, k, v, num_past, d ** -0.5)
    got = cpu_attention.prefill_attention(q, k, v, num_past, d ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:  # bf16 probabilities multiply V, as in PyTorch's bf16 flash kernel
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
        wide = torch.empty(q.shape)  # the same kernel writing float32 rows: unrounded output
        cpu_attention.prefill_attention(q, k, v, num_past, d ** -0.5, out=wide)
        torch.testing.assert_close(wide.double(), want, atol=1e-2, rtol=1e-2)
        assert torch.equal(wide.bfloat16(), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_attention_with_scores_that_grow_along_the_keys(dtype):
    # later keys score far above earlier ones (up to ~300 apart): the running max is raised and
    # the sums rescaled many times, and exp of the early scores underflows to 0
    if not cpu_attention.prefill_supported(dtype, 64):
        pytest.skip(f"this CPU cannot run the native prefill kernel for {dtype}")
    g = torch.Generator().manual_seed(7)
    n, past = 150, 50
    q = torch.randn(n, 6, 64, generator=g).abs().to(dtype)
    k = (torch.randn(past + n, 2, 64, generator=g).abs()
         * torch.linspace(0.1, 6, past + n)[:, None, None]).to(dtype)
    v = torch.randn(past + n, 2, 64, generator=g).to(dtype)
    want = _causal_reference(q, k, v, past, 0.125)
    got = cpu_attention.prefill_attention(q, k, v, past, 0.125, out=torch.empty(q.shape))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_native_prefill_attention_is_the_same_on_any_thread_count():
    dtype = torch.bfloat16 if cpu_attention.prefill_supported(torch.bfloat16, 64) else torch.float32
    if not cpu_attention.prefill_supported(dtype, 64):
        pytest.skip("this CPU cannot run the native prefill kernel")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(90, 9, 64, generator=g).to(dtype)
    k, v = (torch.randn(100, 3, 64, generator=g).to(dtype) for _ in range(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.prefill_attention(q, k, v, 10, 0.125)
        torch.set_num_threads(max(2, threads))
        many = cpu_attention.prefill_attention(q, k, v, 10, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_native_prefill_attention_declines_what_it_cannot_run():
    # the engine asks first and keeps PyTorch's attention for these
    assert not cpu_attention.prefill_supported(torch.float32, 80)
    assert not cpu_attention.prefill_supported(torch.float16, 64)


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors are, elementwise (same-sign values)."""
    return (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()


@pytest.mark.parametrize("t, h", [(1, 5), (7, 33), (3, 576), (16, 64)])
def test_rms_norm_to_bf16_matches_torch(t, h):
    # one pass from the float32 residual to the GEMM's bf16 input: float32 arithmetic rounded
    # once, as F.rms_norm followed by .bfloat16(); a sum in another order may move a value
    # sitting on a rounding boundary by one bf16 step, no more
    from baton.kernels import cpu_fused

    g = torch.Generator().manual_seed(t * 100 + h)
    x, w = torch.randn(t, h, generator=g) * 3, torch.randn(h, generator=g)
    got = cpu_fused.rms_norm_bf16(x, w, 1e-5)
    want = F.rms_norm(x, (h,), w, 1e-5).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (t, h)
    ulps = _bf16_ulps(got, want)
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 0.02


@pytest.mark.parametrize("t, inter", [(1, 3), (5, 17), (9, 1536), (2, 64)])
def test_silu_mul_bf16_matches_torch(t, inter):
    from baton.kernels import cpu_fused

    g = torch.Generator().manual_seed(t + inter)
    gu = (torch.randn(t, 2 * inter, generator=g) * 4).bfloat16()
    gu[0, 0] = float("nan")  # propagates, as in torch
    gu[-1, inter - 1] = -200.0  # exp would overflow: silu is ~0, not NaN
    got = cpu_fused.silu_mul_bf16(gu)
    f = gu.float()
    want = (F.silu(f[:, :inter]) * f[:, inter:]).bfloat16()
    assert got.shape == (t, inter) and bool(got[0, 0].isnan())
    assert abs(float(got[-1, inter - 1])) < 1e-30
    ok = ~want.isnan()
    ok[-1, inter - 1] = False
    assert int(_bf16_ulps(got[ok], want[ok]).max()) <= 1


@pytest.mark.parametrize("t, hq, hkv, d", [(1, 3, 1, 16), (6, 9, 3, 64), (4, 2, 2, 128),
                                           (11, 4, 1, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rope_bf16_matches_the_float32_rotation(t, hq, hkv, d, with_bias):
    # queries and keys rotate at their own positions, values pass through (plus the bias);
    # float_queries returns the rotated queries before rounding
    from baton.engine.model import apply_rope
    from baton.kernels import cpu_fused

    g = torch.Generator().manual_seed(t * hq + d)
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(t, width, generator=g).bfloat16()
    bias = torch.randn(width, generator=g) if with_bias else None
    ang = torch.rand(50, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    pos = torch.randint(0, 50, (t,), generator=g)
    out, qf = cpu_fused.rope_bf16(qkv, bias, cos, sin, pos, hq + hkv, d, float_queries=hq)
    x = qkv.float() + (0 if bias is None else bias)
    x = x.view(t, hq + 2 * hkv, d)
    rot = apply_rope(x[:, : hq + hkv], cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    assert out.shape == (t, hq + 2 * hkv, d) and out.dtype == torch.bfloat16
    torch.testing.assert_close(qf, rot[:, :hq], atol=1e-5, rtol=1e-5)
    assert int(_bf16_ulps(out[:, : hq + hkv], rot.bfloat16()).max()) <= 1
    assert torch.equal(out[:, hq + hkv:], x[:, hq + hkv:].bfloat16())
    out2, none = cpu_fused.rope_bf16(qkv, bias, cos, sin, pos, hq + hkv, d)
    assert none is None and torch.equal(out2, out)


@pytest.mark.parametrize("t, hq, hkv, d", [(1, 3, 1, 16), (6, 9, 3, 64), (4, 2, 2, 128),
                                           (11, 4, 1, 32), (3, 2, 1, 510)])
def test_rope_f32_is_torchs_rotation_bit_for_bit(t, hq, hkv, d):
    # in place on the float32 QKV GEMM output: queries and keys rotated, values untouched, every
    # value equal to apply_rope's (the kernel is built without contraction into fused multiply-add)
    from baton.engine.model import apply_rope
    from baton.kernels import cpu_fused

    g = torch.Generator().manual_seed(t * hq + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 7
    ang = torch.rand(50, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    pos = torch.randint(0, 50, (t,), generator=g)
    x = qkv.clone().view(t, hq + 2 * hkv, d)
    want = apply_rope(x[:, : hq + hkv], cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    got = cpu_fused.rope_f32_(qkv, cos, sin, pos, hq + hkv, d).view(t, hq + 2 * hkv, d)
    assert got.data_ptr() == qkv.data_ptr()
    assert torch.equal(got[:, : hq + hkv], want)
    assert torch.equal(got[:, hq + hkv :], x[:, hq + hkv :])


@pytest.mark.parametrize("t, h", [(1, 5), (7, 33), (3, 576), (16, 64)])
def test_rms_norm_f32_matches_torch(t, h):
    # the sum of squares in another order than torch's: float32 rounding apart
    from baton.kernels import cpu_fused

    g = torch.Generator().manual_seed(t * 100 + h)
    x, w = torch.randn(t, h, generator=g) * 3, torch.randn(h, generator=g)
    got = cpu_fused.rms_norm_f32(x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (h,), w, 1e-5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t, inter", [(1, 3), (5, 17), (9, 1536), (2, 64)])
def test_silu_mul_f32_matches_torch(t, inter):
    from baton.kernels import cpu_fused

    g = torch.Generator().manual_seed(t + inter)
    gu = torch.randn(t, 2 * inter, generator=g) * 4
    gu[0, 0] = float("nan")  # propagates, as in torch
    gu[-1, inter - 1] = -200.0  # exp(200) overflows: silu is -0, not NaN
    got = cpu_fused.silu_mul_f32(gu)
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert got.shape == (t, inter) and bool(got[0, 0].isnan())
    assert float(got[-1, inter - 1]) == 0.0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, equal_nan=True)


def test_loading_the_kernels_leaves_subnormal_floats_alone():
    # a library linked with -ffast-math sets flush-to-zero for the whole process when it loads;
    # torch would then compute 1e-39 * 1 as 0. A fresh process: nothing else loaded them first
    import subprocess
    import sys

    code = ("import torch\n"
            "from baton.kernels import cpu_attention, cpu_fused, cpu_linear\n"
            "assert cpu_attention.load() and cpu_fused.load() and cpu_linear.load()\n"
            "assert cpu_fused.load_f32() and cpu_linear.quant_load()\n"
            "assert cpu_attention.load_prefill()\n"
            "x = torch.tensor([1e-39])\n"
            "print(float(x * 1.0) > 0, float(torch.tensor([1e-38]) / 100) > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("m, n, k", [(1, 7, 32), (3, 33, 96), (16, 5, 64), (2, 1, 160)])
def test_quant_linear_reads_gguf_blocks_exactly(qtype, m, n, k):
    # the kernel's weights are bit for bit the gguf package's dequantized values (scales
    # include subnormal, negative and zero halves), and its products match float64
    from gguf import GGMLQuantizationType, quants

    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=g).numpy()
    w[0, :32] *= 1e-6  # a block whose fp16 scale is subnormal
    if n > 1:
        w[1, 32:64] = 0.0
    qt = GGMLQuantizationType[qtype]
    blocks = quants.quantize(w, qt)
    want_w = torch.from_numpy(quants.dequantize(blocks, qt).astype("float32")).reshape(n, k)
    qw = cpu_linear.QuantWeight(qtype, torch.from_numpy(blocks.copy()), k)
    assert torch.equal(cpu_linear.dequantize(qw), want_w)
    # one-hot rows pick single weights out of the product itself: exact, so the kernel's own
    # dequantization is bit for bit too
    cols = torch.arange(m) % k
    assert torch.equal(cpu_linear.linear(torch.eye(k)[cols], qw), want_w[:, cols].T)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        want = F.linear(x.double(), want_w.double(), None if bias is None else bias.double())
        got = cpu_linear.linear(x, qw, bias)
        assert got.shape == (m, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_a_kernel_cached_for_another_cpu_is_built_again_not_loaded(tmp_path, monkeypatch):
    # a cache (or an image) made on a CPU with other instruction sets must not be loaded here:
    # -march=native code from an AVX-512 machine dies with SIGILL on an AVX2 one
    import shutil

    from baton.kernels import native

    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    here = native.cpu_flags()
    assert native.build("block_hash", [], torch_runtime=False) is not None
    (mine,) = (tmp_path / "kernels").glob("block_hash-*.so")
    assert mine.name.startswith(f"block_hash-{native.isa_tag(here)}-")
    other = frozenset(here ^ {"avx512f", "avx512bw"})  # the same CPU, but for its AVX-512
    monkeypatch.setattr(native, "cpu_flags", lambda: other)
    assert native.build("block_hash", [], torch_runtime=False) is not None
    libs = sorted(p.name for p in (tmp_path / "kernels").glob("block_hash-*.so"))
    assert len(libs) == 2 and mine.name in libs  # built again, under the other CPU's name
    (theirs,) = set(libs) - {mine.name}
    assert theirs.startswith(f"block_hash-{native.isa_tag(other)}-")
    assert native.isa_tag(frozenset({"avx512f", "avx2"})) == "avx512"
    assert native.isa_tag(frozenset({"avx2", "fma"})) == "avx2"


def _windowed_loop(q, k, v, num_past: int, scale: float, window: int) -> torch.Tensor:
    """Query i (position num_past + i) over keys num_past + i - window + 1 .. num_past + i, one
    query at a time in float64: transformers' sliding window (kv_idx > q_idx - window)."""
    n, hq = q.shape[:2]
    group = hq // k.shape[1]
    out = torch.empty(n, hq, q.shape[2], dtype=torch.float64)
    for i in range(n):
        pos = num_past + i
        lo = max(pos - window + 1, 0)
        ks = k[lo: pos + 1].double().repeat_interleave(group, dim=1)
        vs = v[lo: pos + 1].double().repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), ks) * scale, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", w, vs)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, num_past, hkv, group, d, window", [
    (40, 0, 2, 3, 64, 7), (13, 50, 1, 5, 64, 20), (70, 31, 3, 1, 128, 33), (9, 3, 2, 2, 64, 40),
    (50, 10, 1, 3, 256, 16), (37, 70, 2, 3, 64, 1)])
def test_prefill_attention_with_a_sliding_window(dtype, n, num_past, hkv, group, d, window):
    # windows shorter and longer than the prompt, not multiples of the kernel's 32-key blocks,
    # over cached keys; head_dim 256 (Gemma 3) in the native kernel too
    from baton.kernels.paged_attention import prefill_attention

    g = torch.Generator().manual_seed(n * 7 + window)
    q = torch.randn(n, hkv * group, d, generator=g).to(dtype)
    k, v = (torch.randn(num_past + n, hkv, d, generator=g).to(dtype) for _ in range(2))
    want = _windowed_loop(q, k, v, num_past, d ** -0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = prefill_attention(q.double(), k.double(), v.double(), num_past, d ** -0.5, window)
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-6)
    if not cpu_attention.prefill_supported(dtype, d):
        pytest.skip(f"this CPU cannot run the native prefill kernel for {dtype}, head_dim {d}")
    got = cpu_attention.prefill_attention(q, k, v, num_past, d ** -0.5, window)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs, hkv, group, d, window", [
    (4, 3, 3, 16, 6), (4, 2, 2, 64, 9), (16, 2, 1, 64, 3), (8, 1, 4, 64, 17), (4, 1, 2, 256, 5),
    (32, 2, 3, 64, 40)])
def test_paged_decode_attention_with_a_sliding_window(kv_dtype, bs, hkv, group, d, window):
    # each sequence's query sees its last `window` keys: blocks before them skipped, the keys
    # before them in the first block masked (windows not multiples of the block size)
    g = torch.Generator().manual_seed(window)
    nb = 40
    kv = torch.randn(nb, 1, 2, bs, hkv, d, generator=g).to(kv_dtype)
    lens = torch.tensor([1, 5, window, window + 1, 30, 61])
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    scale = d ** -0.5
    for b, n in enumerate(lens.tolist()):  # the reference against one query at a time
        keys = kv[tables[b], 0].transpose(1, 2).reshape(-1, 2, hkv, d)[:n].float()
        want = _windowed_loop(q[b: b + 1], keys[:, 0], keys[:, 1], n - 1, scale, window)
        got = decode_attention(q[b: b + 1], kv, 0, tables[b: b + 1], lens[b: b + 1], scale,
                               window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    want = decode_attention(q, kv, 0, tables, lens, scale, window)  # masked batch form
    for b in range(len(lens)):
        one = decode_attention(q[b: b + 1], kv, 0, tables[b: b + 1], lens[b: b + 1], scale,
                               window)
        torch.testing.assert_close(want[b: b + 1], one, atol=1e-5, rtol=1e-5)
    got = cpu_attention.decode_attention(q, kv, 0, tables, lens, scale, window)
    torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=1e-4)
