"""The FP8 KV cache in the Triton kernels: keys and values stored divided by their layer's scales
as e4m3 (saturating), and the decode and prefill attention kernels reading them against the
torch reference over the dequantized cache.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton
is imported), float32 queries; on a GPU also bf16 ones.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from baton.engine.model import apply_rope  # noqa: E402
from baton.kernels import paged_attention as ref  # noqa: E402
from baton.kernels import triton_attention as tri  # noqa: E402
from baton.kernels import triton_fused as fused  # noqa: E402

from tests.support.kernels import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def fp8_cache(num_blocks, layers, bs, hkv, d, gen):
    """(FP8 cache, float32 scales [layers, 2], the dequantized float32 cache)."""
    kv = (torch.randn((num_blocks, layers, 2, bs, hkv, d), generator=gen) * 100).to(FP8)
    scales = torch.rand((layers, 2), generator=gen) + 0.25
    return kv, scales, kv.float() * scales[None, :, :, None, None, None]


def tables_for(lens, bs, num_blocks, gen):
    perm = torch.randperm(num_blocks, generator=gen)
    width, rows, used = max(-(-n // bs) for n in lens), [], 0
    for n in lens:
        k = -(-n // bs)
        rows.append(perm[used:used + k].tolist() + [int(perm[0])] * (width - k))
        used += k
    return torch.tensor(rows, dtype=torch.int32)


def test_rope_store_kv_writes_scaled_fp8():
    # each key and value divided by its layer's scale and rounded to e4m3 as torch rounds it;
    # beyond the range it saturates at +-448 (no NaN)
    gen = torch.Generator().manual_seed(21)
    hq, hkv, d, t = 6, 2, 24, 7
    qkv = torch.randn((t, (hq + 2 * hkv) * d), generator=gen) * 30
    qkv[2, -1] = 1e6  # a value far beyond FP8's range
    pos = torch.tensor([0, 1, 2, 9, 30, 31, 5])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(64).float()[:, None] * inv[None, :]
    cos, sin = torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()
    kv = torch.zeros((6, 2, 2, 4, hkv, d), dtype=FP8)
    scales = torch.tensor([[1.0, 1.0], [0.37, 2.5]])
    blocks = torch.tensor([0, 0, 1, 5, -1, 3, 2])
    offs = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    dev = [x.to(DEVICE) for x in (qkv, pos, cos, sin, kv, blocks, offs, scales)]
    fused.rope_store_kv(*dev[:4], dev[4], 1, dev[5], dev[6], hq, kv_scales=dev[7])
    got = dev[4].cpu()

    qk = apply_rope(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos[pos].unsqueeze(1),
                    sin[pos].unsqueeze(1))
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    want = torch.zeros((6, 2, 2, 4, hkv, d), dtype=FP8)
    for i in range(t):
        if blocks[i] >= 0:
            for j, (x, s) in enumerate(((qk[i, hq:], 0.37), (v[i], 2.5))):
                want[blocks[i], 1, j, offs[i]] = (x / s).clamp(-448, 448).to(FP8)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.float().abs().max() == 448  # the saturated value
    assert not got.float().isnan().any()


@pytest.mark.parametrize("hq, hkv, d, bs, lens, splits, window", [
    (9, 3, 64, 16, [1, 17, 33], 1, 0),
    (6, 2, 48, 4, [7, 100], 3, 0),     # head dim not a power of two, split contexts
    (4, 4, 32, 8, [5, 64, 65], 2, 13),  # a sliding window
])
def test_decode_attention_reads_fp8_kv(hq, hkv, d, bs, lens, splits, window):
    gen = torch.Generator().manual_seed(hq * d + splits)
    nblocks = sum(-(-n // bs) for n in lens) + 3
    kv, scales, deq = fp8_cache(nblocks, 2, bs, hkv, d, gen)
    tables = tables_for(lens, bs, nblocks, gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    for dtype in DTYPES:
        q = torch.randn((len(lens), hq, d), generator=gen).to(dtype)
        want = ref.decode_attention(q.float(), deq, 1, tables.long(), ctx.long(), d**-0.5, window)
        got = tri.decode_attention(q.to(DEVICE), kv.to(DEVICE), 1, tables.to(DEVICE),
                                   ctx.to(DEVICE), d**-0.5, num_splits=splits, window=window,
                                   kv_scales=scales.to(DEVICE))
        assert got.dtype == dtype
        assert rel_err(got.cpu(), want) < TOL[dtype], (dtype, rel_err(got.cpu(), want))


@pytest.mark.parametrize("hq, hkv, d, bs, chunks, window", [
    (9, 3, 64, 16, [(0, 37), (16, 1), (5, 20)], 0),  # (num_past, new tokens) per sequence
    (4, 2, 32, 8, [(64, 33)], 20),
])
def test_prefill_attention_reads_fp8_kv(hq, hkv, d, bs, chunks, window):
    gen = torch.Generator().manual_seed(len(chunks) + d)
    lens = [p + n for p, n in chunks]
    nblocks = sum(-(-n // bs) for n in lens) + 2
    kv, scales, deq = fp8_cache(nblocks, 3, bs, hkv, d, gen)
    tables = tables_for(lens, bs, nblocks, gen)
    starts = torch.tensor([sum(n for _, n in chunks[:i]) for i in range(len(chunks))],
                          dtype=torch.int32)
    for dtype in DTYPES:
        q = torch.randn((sum(n for _, n in chunks), hq, d), generator=gen).to(dtype)
        out = tri.prefill_attention(
            q.to(DEVICE), kv.to(DEVICE), 2, tables.to(DEVICE), starts.to(DEVICE),
            torch.tensor([n for _, n in chunks], dtype=torch.int32, device=DEVICE),
            torch.tensor([p for p, _ in chunks], dtype=torch.int32, device=DEVICE),
            max(n for _, n in chunks), d**-0.5, window=window, kv_scales=scales.to(DEVICE))
        for (past, n), s, table in zip(chunks, starts.tolist(), tables.long()):
            k, v = ref.gather_kv(deq, 2, table, torch.float32)
            want = ref.prefill_attention(q[s:s + n].float(), k[:past + n], v[:past + n], past,
                                         d**-0.5, window)
            assert rel_err(out[s:s + n].cpu(), want) < TOL[dtype], (dtype, past, n)


# FP8 keys and values (scale 1, 3 mantissa bits) against transformers in float32: the largest
# top-3 logprob difference over 6 teacher-forced steps of these tiny models (weights at
# initializer_range 0.05; the float32 KV cache gives < 1e-5 on the same)
FP8_KV_TOL = 0.1
ENGINE = dict(block_size=4, num_kv_blocks=200, attention_backend="triton",
              max_num_batched_tokens=16, device=DEVICE)


@pytest.mark.slow  # 3-6 s each under the interpreter
@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_an_fp8_kv_cache_stays_close_to_transformers(tmp_path, kind):
    # GQA, q/k norms, a sliding window shorter than the prompt; chunked prefills read the
    # FP8 blocks of earlier chunks, decode reads them all
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.loader import load_model

    from tests.support.families import PROMPT, SHAPES, logprob_gap

    from ..conftest import make_hf_model

    hf = make_hf_model(tmp_path, kind, **SHAPES[kind], initializer_range=0.05)
    model = load_model(tmp_path)
    full = LLMEngine(model, EngineConfig(**ENGINE))
    eng = LLMEngine(model, EngineConfig(kv_cache_dtype="fp8", **ENGINE))
    assert eng.kv_cache.dtype == FP8 and eng.block_nbytes * 4 == full.block_nbytes
    assert eng.fingerprint != full.fingerprint  # the two never exchange blocks
    assert logprob_gap(full, hf, PROMPT[:30], 6) < 1e-4
    gap = logprob_gap(eng, hf, PROMPT[:30], 6)
    assert 1e-4 < gap < FP8_KV_TOL, gap
    eng.check_integrity()


def test_an_fp8_kv_cache_takes_the_checkpoints_scales(tmp_path):
    # compressed-tensors' per-layer self_attn.k_scale / v_scale: the cache divides by them
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.loader import load_model
    from baton.engine.params import SamplingParams
    from safetensors.torch import load_file, save_file

    from ..conftest import make_hf_model

    make_hf_model(tmp_path, num_hidden_layers=2)
    sd = load_file(tmp_path / "model.safetensors")
    scales = {0: (0.5, 2.0), 1: (3.0, 0.25)}
    for i, (k, v) in scales.items():
        sd[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        sd[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(sd, tmp_path / "model.safetensors")
    eng = LLMEngine(load_model(tmp_path), EngineConfig(kv_cache_dtype="fp8", **ENGINE))
    assert eng.model.kv_scales.cpu().tolist() == [list(scales[0]), list(scales[1])]
    out = eng.generate([list(range(5, 30))], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    eng.check_integrity()


def test_an_fp8_kv_cache_on_the_cpu_kernels_is_refused():
    from baton.engine.config import EngineConfig
    from baton.engine.errors import InvalidRequestError
    from baton.services.common.config import EngineSettings

    with pytest.raises(InvalidRequestError, match="kv_cache_dtype.*needs a CUDA device"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    settings = EngineSettings(None, "float32", None, 16, 8, None, device="cpu",
                              kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8.*needs a GPU"):
        settings.engine_config(record_kv_events=False)
