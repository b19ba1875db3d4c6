"""bench/gpu.py's mixture-of-experts and FP8 parts (``--skip moe,fp8`` leaves them out).

  moe       a Qwen3-30B-A3B-shaped model cut to 6 of its 48 layers (hidden 2048, 32/4 heads of
            128, q/k norms, 128 experts of 768, top-8 normalised; random weights), bf16 and FP8
            (128x128 block scales, activations per token and 128 columns): decode at batch 1
            and 64, context 1k, as a fraction of copy bandwidth over the bytes the step actually
            reads (attention and router weights, the head, the KV, and every layer's experts
            that some row of the batch was routed to: the union over the batch, counted from the
            step's own routing); prefill of 2k tokens as a fraction of the matmul rate of its
            dtype (bf16, or FP8 ``torch._scaled_mm``) over the FLOPs of the experts each token
            uses.
  fp8       the Llama-3-8B-shaped model with FP8 block-scaled weights: decode at batch 1 and 32
            over the bytes read (FP8 weights and their scales), prefill of 2k tokens over the
            FP8 matmul rate.

Correctness first: each FP8 model's last-token logits against the bf16 model's on the same
prompt (relative error, and whether the top token agrees).

``--smoke`` runs all of it on CPU with tiny shapes under Triton's interpreter (CI), timed by the
host clock: the code paths, not figures; its JSON says ``"smoke": true``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

BLOCK = (128, 128)  # the official FP8 releases' weight blocks
SMOKE_BLOCK = (32, 32)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where and at what size a part runs: the real shapes on CUDA, tiny ones in smoke mode."""

    device: str
    smoke: bool

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on a GPU; float32 on CPU, where the Triton path computes in float32."""
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def block(self) -> tuple[int, int]:
        return SMOKE_BLOCK if self.smoke else BLOCK

    def time(self, fn, reps: int, warmup: int = 2) -> float:
        """Median seconds of ``fn()``: CUDA events on a GPU, the host clock in smoke mode."""
        if self.device == "cuda":
            from baton.bench.gpu import cuda_time

            return cuda_time(fn, reps, warmup)
        times = []  # smoke: one untimed-quality run, the code path is the point
        for _ in range(1):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def qwen3_moe_config(setup: Setup, max_position: int):
    """Qwen3-30B-A3B's shapes (6 of 48 layers), or a tiny model of the same kind."""
    from baton.engine.config import ModelConfig

    if setup.smoke:
        dims = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, num_experts=16, experts_per_token=4, moe_intermediate_size=32)
    else:
        dims = dict(vocab_size=151936, hidden_size=2048, num_layers=6, num_heads=32,
                    num_kv_heads=4, head_dim=128, num_experts=128, experts_per_token=8,
                    moe_intermediate_size=768)
    n = dims["num_layers"]
    return ModelConfig(arch="qwen3_moe", intermediate_size=6144, max_position=max_position,
                       rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
                       moe_layers=tuple(range(n)), norm_topk_prob=True, **dims)


def dense_config(setup: Setup, max_position: int):
    from baton.bench.gpu import llama3_8b_config
    from baton.engine.config import ModelConfig

    if setup.smoke:
        return ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           max_position=max_position)
    return llama3_8b_config(max_position)


def random_weights(cfg, setup: Setup) -> dict[str, torch.Tensor]:
    """Random weights in Baton's fused names (a dense or a MoE layout), scaled so activations
    stay finite."""
    g = torch.Generator(device=setup.device).manual_seed(0)
    dtype = setup.dtype

    def rnd(*shape, std=0.02):
        return (torch.randn(shape, generator=g, device=setup.device) * std).to(dtype)

    def ones(n):
        return torch.ones(n, device=setup.device, dtype=dtype)

    h = cfg.hidden_size
    w = {"embed": rnd(cfg.vocab_size, h, std=1.0), "lm_head": rnd(cfg.vocab_size, h),
         "norm": ones(h)}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        w[p + "attn_norm"], w[p + "mlp_norm"] = ones(h), ones(h)
        w[p + "qkv"] = rnd(cfg.q_size + 2 * cfg.kv_size, h)
        w[p + "o"] = rnd(h, cfg.q_size)
        if cfg.qk_norm:
            w[p + "q_norm"], w[p + "k_norm"] = ones(cfg.head_dim), ones(cfg.head_dim)
        if cfg.is_moe(n):
            e, i = cfg.num_experts, cfg.moe_intermediate_size
            w[p + "router"] = rnd(e, h, std=0.1)
            w[p + "experts_gate_up"] = rnd(e * 2 * i, h)
            w[p + "experts_down"] = rnd(e * h, i)
        else:
            w[p + "gate_up"] = rnd(2 * cfg.intermediate_size, h)
            w[p + "down"] = rnd(h, cfg.intermediate_size)
    return w


def quantize_fp8(weights: dict[str, torch.Tensor], block: tuple[int, int]) -> dict:
    """``weights`` as an FP8 checkpoint on a GPU loads: every linear weight e4m3 with one scale
    per ``block`` (amax / 448), kept as per-row group scales ``name.scale``; the rest as is."""
    from baton.engine import fp8
    from baton.engine.loader import FP8_LINEARS

    out = {}
    for name, w in weights.items():
        if name.rsplit(".", 1)[-1] not in FP8_LINEARS:
            out[name] = w
            continue
        n, k = w.shape
        bn, bk = block
        pad = torch.zeros((-(-n // bn) * bn, -(-k // bk) * bk), device=w.device)
        pad[:n, :k] = w.float()
        amax = pad.view(pad.shape[0] // bn, bn, -1, bk).abs().amax(dim=(1, 3))
        scale = amax.clamp_min(1e-12) / 448.0
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        out[name] = (w.float() / full).to(torch.float8_e4m3fn)
        out[name + ".scale"] = fp8.expand_scale(scale, n, k, block)
    return out


def build(cfg, weights: dict, setup: Setup, fp8: bool):
    """The engine's model on ``weights`` (bf16), FP8-quantized first with ``fp8``."""
    from baton.engine.model import LlamaModel

    group = setup.block[1] if fp8 else None
    w = quantize_fp8(weights, setup.block) if fp8 else weights
    return LlamaModel(cfg, w, setup.dtype, attention_backend="triton", fp8_group=group)


def step_bytes(model, cfg, experts_read: list[int]) -> int:
    """Bytes of weight a decode step reads: every layer's attention, norms, router and the
    experts the batch was routed to (``experts_read``: one count per MoE layer, in order), the
    final norm and the head."""
    def size(t):
        return 0 if t is None else t.numel() * t.element_size()

    def lin(x):
        if x is None:
            return 0
        return size(getattr(x, "w", None)) + size(getattr(x, "scale", None))

    total = size(model.lm_head.w) + size(model.norm)
    routed = iter(experts_read)
    for layer in model.layers:
        total += lin(layer.qkv) + lin(layer.o) + lin(layer.gate_up) + lin(layer.down)
        total += size(layer.attn_norm) + size(layer.mlp_norm) + size(layer.q_norm)
        total += size(layer.k_norm) + size(layer.router)
        if layer.router is not None:
            per = (size(layer.experts_gate_up) + size(layer.experts_down)) // cfg.num_experts
            if layer.experts_fp8 is not None:
                per += (size(layer.experts_fp8[0]) + size(layer.experts_fp8[1])) // cfg.num_experts
            total += next(routed) * per
    return total


def experts_routed(model, run) -> list[int]:
    """Per MoE layer, how many distinct experts ``run()`` (one forward) routed rows to."""
    from baton.engine import model as model_mod

    seen: list[int] = []
    plain = model_mod.route

    def route(x, router, cfg):
        weights, experts = plain(x, router, cfg)
        seen.append(int(experts.unique().numel()))
        return weights, experts

    model_mod.route = route
    try:
        run()
    finally:
        model_mod.route = plain
    return seen


# =================================================================================================
# Ceilings, rows
# =================================================================================================


def matmul_fp8_flops(setup: Setup) -> float:
    """The FP8 matrix-product rate: ``torch._scaled_mm`` on 8192^3 e4m3 operands (per-tensor
    scales, bf16 out), the rate FP8 prefill is measured against."""
    m = 256 if setup.smoke else 8192
    a = torch.randn((m, m), device=setup.device).to(torch.float8_e4m3fn)
    b = torch.randn((m, m), device=setup.device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=setup.device)
    out = torch.bfloat16 if setup.device == "cuda" else torch.float32
    t = setup.time(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=out),
                   20)
    return 2 * m**3 / t


def smoke_ceilings(setup: Setup) -> dict:
    """Host-clock ceilings for ``--smoke`` (their ratios mean nothing; the code paths run)."""
    src = torch.randn(1 << 20)
    dst = torch.empty_like(src)
    copy = 2 * src.nbytes / setup.time(lambda: dst.copy_(src), 5)
    a = torch.randn((256, 256), dtype=torch.bfloat16)
    return {"copy_bytes_per_s": copy,
            "matmul_bf16_flops": 2 * 256**3 / setup.time(lambda: a @ a, 5)}


def _kv(cfg, setup: Setup, blocks: int, bs: int = 16) -> torch.Tensor:
    return torch.randn((blocks, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim),
                       device=setup.device).to(setup.dtype)


def decode_row(model, cfg, setup: Setup, b: int, ctx: int, ceil: dict) -> dict:
    """One decode step of batch ``b`` at context ``ctx``: a CUDA graph's replay on a GPU."""
    from baton.engine.model import AttentionMetadata
    from baton.kernels.triton_attention import decode_splits

    bs, dev = 16, setup.device
    per = -(-(ctx + 1) // bs)
    kv = _kv(cfg, setup, b * per + 1, bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    pos = ctx - 1
    ids = torch.randint(0, cfg.vocab_size, (b,)).tolist()
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4
    meta = AttentionMetadata(
        slot_blocks=torch.tensor([t[pos // bs] for t in tables], device=dev),
        slot_offsets=torch.full((b,), pos % bs, device=dev),
        decode_block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        decode_context_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev),
        decode_splits=decode_splits(b, cfg.num_kv_heads, ctx, sms))
    idt, pst = torch.tensor(ids, device=dev), torch.full((b,), pos, device=dev)
    rows = torch.arange(b, device=dev)

    def step():
        return model.forward(idt, pst, meta, kv, rows)

    read = experts_routed(model, step)
    finite = bool(torch.isfinite(step()).all())
    run = step
    if dev == "cuda":
        from baton.engine.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(model, kv, b, ctx + bs, bs, sizes=[b])
        graphs.run(ids, [pos] * b, [t[pos // bs] for t in tables], tables, [ctx] * b)
        run = graphs.graphs[b].replay
    t = setup.time(run, 30, warmup=5)
    wbytes = step_bytes(model, cfg, read)
    kv_read = b * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv.element_size()
    return {"batch": b, "context": ctx, "step_ms": t * 1e3, "weight_bytes": wbytes,
            "kv_bytes": kv_read, "experts_read_per_layer": read,
            "bandwidth_util": (wbytes + kv_read) / t / ceil["copy_bytes_per_s"],
            "tokens_per_s": b / t, "logits_finite": finite}


def prefill_flops(cfg, n: int) -> tuple[float, float]:
    """(all, attention) FLOPs of an ``n``-token prefill: each token's attention projections,
    router and its top-k experts (or the dense MLP), causal attention, the head for one row."""
    h, layers = cfg.hidden_size, cfg.num_layers
    proj = (cfg.q_size + 2 * cfg.kv_size) * h + h * cfg.q_size
    mlp = 0
    for i in range(layers):
        if cfg.is_moe(i):
            mlp += cfg.num_experts * h + cfg.experts_per_token * 3 * h * cfg.moe_intermediate_size
        else:
            mlp += 3 * h * cfg.intermediate_size
    attn = layers * cfg.num_heads * 4 * cfg.head_dim * (n * (n + 1) / 2)
    return 2 * n * (layers * proj + mlp) + attn + 2 * cfg.vocab_size * h, attn


def _prefill_meta(n: int, bs: int, dev: str):
    from baton.engine.model import AttentionMetadata

    return AttentionMetadata(
        slot_blocks=torch.arange(n, device=dev) // bs,
        slot_offsets=torch.arange(n, device=dev) % bs,
        prefill_block_tables=torch.arange(-(-n // bs), dtype=torch.int32, device=dev)[None, :],
        prefill_starts=torch.zeros(1, dtype=torch.int32, device=dev),
        prefill_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        prefill_past=torch.zeros(1, dtype=torch.int32, device=dev), max_prefill_len=n)


def prefill_logits(model, cfg, setup: Setup, n: int):
    """A function running an ``n``-token prefill (nothing cached): the last row's logits."""
    bs, dev = 16, setup.device
    kv = _kv(cfg, setup, -(-n // bs) + 1, bs)
    meta = _prefill_meta(n, bs, dev)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    ids, positions = ids.to(dev), torch.arange(n, device=dev)
    last = torch.tensor([n - 1], device=dev)
    return lambda: model.forward(ids, positions, meta, kv, last)


def prefill_row(model, cfg, setup: Setup, n: int, rate: float) -> dict:
    fwd = prefill_logits(model, cfg, setup, n)
    finite = bool(torch.isfinite(fwd()).all())
    t = setup.time(fwd, 10 if n <= 2048 else 5)
    flops, attn = prefill_flops(cfg, n)
    return {"tokens": n, "ms": t * 1e3, "flops": flops, "attention_flops": attn,
            "flop_util": flops / t / rate, "logits_finite": finite}


def check_fp8(bf16_model, fp8_model, cfg, setup: Setup) -> dict:
    """The FP8 model's last-token logits against the bf16 model's on one prompt."""
    n = 16 if setup.smoke else 64
    a = prefill_logits(bf16_model, cfg, setup, n)().float()
    b = prefill_logits(fp8_model, cfg, setup, n)().float()
    err = float((a - b).norm() / a.norm().clamp_min(1e-30))
    return {"tokens": n, "logits_rel_err": err, "top1_agrees": bool(a.argmax() == b.argmax())}


# =================================================================================================
# Parts
# =================================================================================================


def bench_moe(ceil: dict, setup: Setup, batches: list[int], prefill: int, ctx: int) -> dict:
    """The layer-truncated Qwen3-30B-A3B in bf16 and FP8: decode and prefill rows of each."""
    cfg = qwen3_moe_config(setup, max(prefill, ctx + 16, 8192))
    weights = random_weights(cfg, setup)
    models = {"bf16": build(cfg, weights, setup, False), "fp8": build(cfg, weights, setup, True)}
    del weights
    out = {"config": f"qwen3-30b-a3b-shaped, {cfg.num_layers} of 48 layers"
                     + (" (smoke: tiny)" if setup.smoke else ""),
           "check": check_fp8(models["bf16"], models["fp8"], cfg, setup)}
    for name, model in models.items():
        rate = ceil["matmul_fp8_flops" if name == "fp8" else "matmul_bf16_flops"]
        out[name] = {"decode": [decode_row(model, cfg, setup, b, ctx, ceil) for b in batches],
                     "prefill": [prefill_row(model, cfg, setup, prefill, rate)]}
    return out


def bench_dense_fp8(ceil: dict, setup: Setup, batches: list[int], prefill: int, ctx: int
                    ) -> dict:
    """The Llama-3-8B-shaped model with FP8 block-scaled weights."""
    cfg = dense_config(setup, max(prefill, ctx + 16, 8192))
    weights = random_weights(cfg, setup)
    bf16 = build(cfg, weights, setup, False)
    model = build(cfg, weights, setup, True)
    check = check_fp8(bf16, model, cfg, setup)
    del weights, bf16
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    return {"config": "llama3-8b-shaped, FP8 128x128 blocks" + (" (smoke)" if setup.smoke else ""),
            "check": check,
            "decode": [decode_row(model, cfg, setup, b, ctx, ceil) for b in batches],
            "prefill": [prefill_row(model, cfg, setup, prefill, ceil["matmul_fp8_flops"])]}


def table(res: dict) -> list[str]:
    """print_table's lines for these parts."""
    lines = []
    for part, label in (("moe", "moe"), ("fp8_dense", "8b-fp8")):
        r = res.get(part)
        if not r:
            continue
        c = r["check"]
        lines.append(f"{label:7s} check: logits rel err {c['logits_rel_err']:.2e} vs bf16, "
                     f"top-1 {'agrees' if c['top1_agrees'] else 'DIFFERS'}")
        runs = {"": r} if part == "fp8_dense" else {k: r[k] for k in ("bf16", "fp8")}
        for name, rows in runs.items():
            for d in rows["decode"]:
                lines.append(f"{label:7s}{name:5s} decode batch {d['batch']:3d}: "
                             f"{d['step_ms']:8.3f} ms {d['bandwidth_util']:6.1%} of copy bw "
                             f"({d['weight_bytes'] / 2**30:.2f} GiB weights read)")
            for p in rows["prefill"]:
                lines.append(f"{label:7s}{name:5s} prefill {p['tokens']:5d}: {p['ms']:8.2f} ms "
                             f"{p['flop_util']:6.1%} of the matmul rate")
    return lines
