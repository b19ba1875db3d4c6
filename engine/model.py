"""A dense decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Gemma 3 text) over a paged KV cache.

The forward pass takes the flattened tokens of a whole batch (any mix of prefill chunks and single
decode tokens), so every matmul runs once per layer for the batch; only attention is per group.
Weights are plain tensors, fused per layer: ``qkv`` = [q; k; v] and ``gate_up`` = [gate; up].
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import mmap
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from baton.engine.config import ModelConfig, RopeScaling
from baton.kernels import cpu_attention, cpu_fused, cpu_linear
from baton.kernels.paged_attention import (
    decode_attention,
    gather_kv,
    prefill_attention,
    store_kv,
)


@dataclass
class PrefillSeq:
    """A sequence with ``n > 1`` new tokens at rows ``[start, start + n)`` of the batch."""

    start: int
    n: int
    num_past: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks covering num_past + n]


@dataclass
class AttentionMetadata:
    """Where each batch row's keys go, and which rows attend how.

    Rows with one new token (decode steps, or a 1-token prefill chunk) share one batched
    ``decode_attention`` call; longer chunks run ``prefill_attention`` one sequence at a time.
    """

    slot_blocks: torch.Tensor  # [T] block id of each new token
    slot_offsets: torch.Tensor  # [T] offset inside that block
    decode_rows: torch.Tensor | None = None  # [B] rows of single-token sequences; None if all
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [B]
    prefills: list[PrefillSeq] = field(default_factory=list)
    # Triton backend (CUDA): the decode kernel's context splits, and every prefill chunk of the
    # batch described for one kernel launch (see ``kernels/triton_attention.py``)
    decode_splits: int = 1
    prefill_block_tables: torch.Tensor | None = None  # [S, max_blocks]
    prefill_starts: torch.Tensor | None = None  # [S] first row of each chunk
    prefill_lens: torch.Tensor | None = None  # [S] new tokens of each chunk
    prefill_past: torch.Tensor | None = None  # [S] tokens cached before each chunk
    max_prefill_len: int = 0

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_context_lens is None else int(self.decode_context_lens.shape[0])


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary inverse frequencies, with linear or llama3-style scaling (as Hugging Face
    computes)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:  # GGUF llama3 models ship the scaling as a tensor
        return inv / freq_factors.float()
    rs = cfg.rope_scaling
    if rs.kind == "linear":
        return inv / rs.factor
    if rs.kind == "llama3":
        low_wavelen = rs.original_max_position / rs.low_freq_factor
        high_wavelen = rs.original_max_position / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(cfg: ModelConfig, freq_factors: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position, [max_position, D] in ``dtype`` on ``device`` (halves
    duplicated: the rotate-half convention), computed in float32 on CPU."""
    inv = rope_inv_freq(cfg, None if freq_factors is None else freq_factors.cpu())
    freqs = torch.arange(cfg.max_position, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op, same arithmetic
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def qk_norm(qk: torch.Tensor, layer, num_heads: int, eps: float) -> torch.Tensor:
    """Qwen3's and Gemma 3's per-head RMSNorm of the query heads and the key heads of ``qk``
    ([T, Hq + Hkv, D]), before RoPE: a new tensor."""
    return torch.cat((rms_norm(qk[:, :num_heads], layer.q_norm, eps),
                      rms_norm(qk[:, num_heads:], layer.k_norm, eps)), dim=1)


def gate_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for ``gate_up`` = [gate | up] (a fresh tensor, reused in place): SiLU
    (Llama, Qwen, Mistral) or tanh-approximated GeLU (Gemma 3)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate, inplace=True).mul_(up)
    return F.gelu(gate, approximate="tanh").mul_(up)


def route(x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each [T, experts_per_token]: every row's experts by softmax over the
    router's logits (in float32), their weights renormalised with ``norm_topk_prob``."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = probs.topk(cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def moe(x: torch.Tensor, layer, cfg: ModelConfig) -> torch.Tensor:
    """A mixture-of-experts MLP on the normed rows ``x`` [T, hidden] (the CPU engine's, and the
    reference of ``kernels/triton_moe.py``): the (row, expert) pairs of :func:`route` sorted by
    expert so that each expert hit multiplies its rows in one GEMM pair on the stacked weights,
    the weighted results added into each row in expert order (as transformers adds them)."""
    k = cfg.experts_per_token
    weights, experts = route(x, layer.router, cfg)
    flat, weights = experts.reshape(-1), weights.reshape(-1)
    order = flat.argsort(stable=True)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=cfg.num_experts).tolist()):
        if n:
            pairs = order[start:start + n]
            start += n
            rows = pairs // k
            act = gate_mul(F.linear(x[rows], layer.experts_gate_up[e]), cfg.hidden_act)
            y = F.linear(act, layer.experts_down[e])
            out.index_add_(0, rows, y * weights[pairs, None].to(y.dtype))
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] (halves duplicated, rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Batches of at most this many rows run linear layers in the native small-M kernel (bound by
# weight bandwidth); larger ones in CPU BLAS (bound by arithmetic). Measured on a 2-core Zen 3:
# the native kernel is 2-3x faster than float32 BLAS at 1-8 rows and even at 16. A bf16 weight
# prepacked for oneDNN never uses it: on a 2-vCPU AMX Xeon the packed GEMM is as fast at 1-2
# rows and up to 1.4x faster at 3-16 (decode step at 4 rows, 1 thread: 56.8 -> 38.9 ms). bf16
# weights that cannot be packed take it up to SMALL_M_HALF rows.
SMALL_M = 16
SMALL_M_HALF = 4
# GGUF blocks read in place (float32 engine, cpu_linear.QuantWeight): a decode step of the
# SmolLM2 Q4_1 file on the 2-vCPU AMX Xeon, 500-token contexts, against float32 BLAS:
# 24 rows 96 -> 87 ms, 32 rows 118 -> 114 ms
SMALL_M_BLOCKS = 32
# A float32 weight prepacked for oneDNN (make_linear) takes over above 4 rows, from the blocks
# and from float32 weights alike. Decode steps of the SmolLM2 Q4_1 file on a 2-vCPU Zen 4,
# 500-token contexts, blocks -> packed: 1 row 12.7 -> 32.5 ms (the blocks stream at a quarter
# of the bytes), 4 rows 23 -> 31, 8 rows ~equal, 32 rows 125 -> 93 ms.
SMALL_M_PACKED = 4
# A bf16 engine from a GGUF file reads the blocks, each weight rounded to its bf16 value, up to
# this many rows (x rounded to bf16 too: the bf16 GEMM's products) instead of the prepacked
# bf16 weights: a quarter to a half of the bytes, but the rounding costs arithmetic. Decode
# steps of the SmolLM2 Q4_1 file on a 2-vCPU Zen 4 (AVX512-BF16), 500-token contexts, packed
# -> blocks: 2 threads, 1 row 21.0 -> 14.7 ms, 2 rows 22.6 -> 16.3, 4 rows equal; 1 thread,
# 1 row 26.8 -> 24.7, 4 rows 26.7 -> 35.9.
SMALL_M_HALF_BLOCKS = 2


class Linear:
    """``y = x @ w.T + bias``, float32 in and out. ``small`` is the same matrix for the native
    small-M kernel, in the storage dtype (bfloat16 weights stream at half the bytes), or ``None``
    to always use BLAS. ``w`` is in the GEMM dtype: float32, or bfloat16 on a CPU with bf16
    arithmetic (``x`` is rounded to it for the product). ``packed`` is ``w`` prepacked for oneDNN
    where PyTorch can: for bf16, otherwise every product repacks the whole matrix into the AMX
    layout (~30% of a decode step's linear time at 8-128 rows); for float32, oneDNN's GEMM on it
    beats CPU BLAS on the plain matrix, and ``w`` is only the reference. With ``transposed``,
    ``w`` is stored as [K, N] for BLAS (faster for a very tall float32 matrix)."""

    __slots__ = ("w", "bias", "small", "transposed", "small_m", "packed")

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, small: torch.Tensor | None,
                 transposed: bool = False, packed: torch.Tensor | None = None):
        self.w, self.bias, self.small, self.transposed = w, bias, small, transposed
        if packed is not None:  # bf16 packed: only bf16-rounded blocks (or nothing) beside it
            self.small_m = SMALL_M_PACKED if w.dtype == torch.float32 else SMALL_M_HALF_BLOCKS
        elif isinstance(small, cpu_linear.QuantWeight):
            self.small_m = SMALL_M_BLOCKS
        else:
            self.small_m = SMALL_M if w.dtype == torch.float32 else SMALL_M_HALF
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and x.shape[0] <= self.small_m:
            return cpu_linear.linear(x, self.small, self.bias)
        if self.packed is not None and self.w.dtype == x.dtype:  # float32, prepacked
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.w.dtype != x.dtype:  # a bf16 GEMM: float32 accumulation, float32 out
            y = self._half_gemm(x).float()
            return y if self.bias is None else y + self.bias
        if self.transposed:
            return x @ self.w
        return F.linear(x, self.w, self.bias)

    def product(self, xh: torch.Tensor) -> torch.Tensor:
        """``xh @ w.T`` for a bf16 ``xh`` and a prepacked bf16 ``w``: bf16 [M, N], no bias."""
        if self.small is not None and xh.shape[0] <= self.small_m:  # bf16-rounded blocks
            return cpu_linear.linear(xh.float(), self.small).bfloat16()  # exact: already bf16
        return torch.ops.mkldnn._linear_pointwise(xh, self.packed, None, "none", [], "")

    def _half_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for a bf16 ``w``, ``x`` rounded to bf16; the bf16 product, no bias."""
        xh = x.to(self.w.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(xh, self.packed, None, "none", [], "")
        return xh @ self.w if self.transposed else F.linear(xh, self.w)

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> None:
        """``h += self(x)``, in place, with the same result: a bf16 GEMM's output is added to
        the float32 ``h`` as it is (the add widens it exactly), so no float32 copy of it is
        made. In a 2k-token prefill those copies and their fresh pages cost more than the add."""
        if (self.bias is None and self.w.dtype != x.dtype
                and (self.small is None or x.shape[0] > self.small_m)):
            h.add_(self._half_gemm(x))
        else:
            h.add_(self(x))


def prepack(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` [N, K] (float32 or bf16) in oneDNN's blocked layout for
    ``mkldnn._linear_pointwise``, or None where this PyTorch build cannot (no oneDNN): the plain
    GEMM is used then."""
    return torch.ops.mkldnn._reorder_linear_weight(w) if _packing_works(w.dtype) else None


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    """Whether this PyTorch has oneDNN's prepacked linear for ``dtype`` and it agrees with
    F.linear (a float32 one to float32 rounding: no reduced-precision math mode)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(8, 64, generator=gen).to(dtype)
        x = torch.randn(2, 64, generator=gen).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        return torch.allclose(y.float(), F.linear(x, w).float(), rtol=tol, atol=tol)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def resident(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy of ``t`` (in ``dtype``) in the process's own memory, on transparent
    huge pages where the kernel allows them. Weights loaded from safetensors are views of the
    mmapped file: decode streams every weight once per step, and streaming them from the page
    cache in 4 KiB pages made a float32 decode step ~1.4x slower (2-vCPU Xeon with AMX)."""
    dtype = dtype or t.dtype
    nbytes = t.numel() * dtype.itemsize
    if t.device.type != "cpu" or nbytes < _HUGE_PAGE:
        return t.to(dtype, copy=True).contiguous()
    # anonymous and private (a shared mapping would be shmem, which THP leaves alone); freed with
    # the last tensor using it
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(buf)
    out = torch.frombuffer(buf, dtype=dtype, count=t.numel()).view(t.shape)
    out.copy_(t)
    return out


_HUGE_PAGE = 1 << 21

# "0": the weights and the KV pool stay on plain 4 KiB pages (see advise_huge_pages)
HUGE_PAGES_ENV = "BATON_HUGE_PAGES"


def huge_pages() -> bool:
    """Whether the engine asks for transparent huge pages: yes unless ``$BATON_HUGE_PAGES`` is
    ``0``. Raises ValueError naming the variable for a value other than 0 or 1."""
    raw = os.environ.get(HUGE_PAGES_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"${HUGE_PAGES_ENV}={raw!r}: 1 (transparent huge pages, the default) "
                         "or 0 (plain pages)")
    return raw == "1"


def advise_huge_pages(region: mmap.mmap) -> None:
    """Advise ``region`` to use transparent huge pages, unless ``$BATON_HUGE_PAGES=0`` (or the
    kernel has THP off: plain pages, same data). Faulting a huge page in costs more where the
    hypervisor backs guest memory lazily: on the 2-vCPU Firecracker VM an engine with a 1 GiB
    pool started in 12.0 s on huge pages against 1.8 s on plain ones and decoded 1.03x as fast
    (``bench/huge_pages.py``); a short-lived worker (the tests') starts faster without them, a
    long-lived one pays it once."""
    if huge_pages() and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)


def make_linear(t: torch.Tensor, bias: torch.Tensor | None, small_dtype: torch.dtype | None,
                gemm_dtype: torch.dtype, transposed: bool = False,
                blocks: tuple[str, torch.Tensor] | None = None, pack: bool = True) -> Linear:
    """A :class:`Linear` for weight ``t`` ([N, K], compute dtype), sharing one copy between the
    small-M kernel and BLAS where the dtypes allow it. With ``pack`` (CPU), the GEMM runs on a
    copy prepacked for oneDNN where this PyTorch can; ``transposed`` (a very tall matrix) applies
    to a plain float32 GEMM only. ``blocks`` (GGUF block type, uint8 blocks) are ``t``'s own
    source blocks: with a float32 small-M kernel, it reads those."""
    readable = blocks is not None and cpu_linear.QuantWeight.usable(blocks[0], t.shape[1])
    if small_dtype == torch.float32 and readable:
        small = cpu_linear.QuantWeight(blocks[0], blocks[1], t.shape[1])
    else:
        small = None if small_dtype is None else resident(t, small_dtype)
    plain = small if isinstance(small, torch.Tensor) and small.dtype == gemm_dtype else None
    packed = None
    if pack and gemm_dtype == torch.bfloat16 and t.dtype != gemm_dtype:  # bf16 GEMMs
        plain = plain if plain is not None else resident(t, gemm_dtype)
        packed = prepack(plain)
        if packed is not None:  # faster than the native kernel at every batch (SMALL_M_HALF)
            # but not than the GGUF blocks, rounded to these bf16 weights as they are read
            # (SMALL_M_HALF_BLOCKS)
            small = (cpu_linear.QuantWeight(blocks[0], blocks[1], t.shape[1], round_bf16=True)
                     if small_dtype == torch.bfloat16 and readable else None)
    elif pack and gemm_dtype == torch.float32 == t.dtype and t.device.type == "cpu":
        # oneDNN's prepacked float32 GEMM against CPU BLAS (F.linear) on a 2-vCPU Zen 4, SmolLM2
        # shapes: 1.4-1.8x at 32 rows, 1.1-1.4x at 1,024; the small-M kernel stays faster at a
        # few rows (SMALL_M_PACKED). ``w`` is then kept as the reference, not copied.
        packed = prepack(t.contiguous())
        if packed is not None:
            return Linear(plain if plain is not None else t, bias, small, False, packed)
    if transposed and packed is None:
        return Linear(resident(t.t(), gemm_dtype), bias, small, True)
    return Linear(plain if plain is not None else resident(t, gemm_dtype), bias, small, False,
                  packed)


class Fp8Linear:
    """``y = x @ W.T + bias`` for an FP8 weight kept with per-row group scales (an FP8
    checkpoint on a GPU): ``x`` quantized per token (and group) as it arrives, one FP8 matmul
    (``baton.kernels.triton_fp8``), the result in x's dtype."""

    __slots__ = ("w", "scale", "group", "bias", "matmul")

    def __init__(self, w: torch.Tensor, scale: torch.Tensor, group: int,
                 bias: torch.Tensor | None) -> None:
        from baton.kernels import triton_fp8

        self.w, self.scale, self.group, self.bias = w, scale, group, bias
        self.matmul = triton_fp8.matmul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.w, self.scale, self.group, self.bias)


class Layer:
    def __init__(self, w: dict[str, torch.Tensor], small_dtype: torch.dtype | None,
                 gemm_dtype: torch.dtype,
                 blocks: dict[str, tuple[str, torch.Tensor]] | None = None,
                 pack: bool = True, fp8_group: int | None = None) -> None:
        def lin(name, bias=None):
            if name + ".scale" in w:  # kept FP8 (only where the engine has FP8 matmuls)
                return Fp8Linear(w[name], w[name + ".scale"], fp8_group, bias)
            return make_linear(w[name], bias, small_dtype, gemm_dtype,
                               blocks=(blocks or {}).get(name), pack=pack)

        self.attn_norm = w["attn_norm"]
        self.qkv = lin("qkv", w.get("qkv_bias"))  # [q_size + 2 * kv_size, hidden]
        self.o = lin("o")  # [hidden, q_size]
        self.mlp_norm = w["mlp_norm"]
        # Qwen3, Gemma 3: per-head norms of q and k ([head_dim]); Gemma 3: norms of the
        # attention's and the MLP's outputs before each residual add ([hidden])
        self.q_norm, self.k_norm = w.get("q_norm"), w.get("k_norm")
        self.post_attn_norm, self.post_mlp_norm = w.get("post_attn_norm"), w.get("post_mlp_norm")
        # a mixture-of-experts layer: the router [E, hidden] and the experts stacked,
        # [E, 2 * moe_intermediate, hidden] (gate rows, then up rows) and [E, hidden, moe_int.]
        self.router = w.get("router")
        if self.router is not None:
            e = self.router.shape[0]
            self.experts_gate_up = w["experts_gate_up"].view(e, -1, self.router.shape[1])
            self.experts_down = w["experts_down"].view(e, self.router.shape[1], -1)
            self.gate_up = self.down = None
            # FP8 experts: their per-row group scales, [E, 2I, G] and [E, hidden, G']
            self.experts_fp8 = None if "experts_gate_up.scale" not in w else (
                w["experts_gate_up.scale"].view(e, self.experts_gate_up.shape[1], -1),
                w["experts_down.scale"].view(e, self.router.shape[1], -1), fp8_group)
            return
        self.gate_up = lin("gate_up")  # [2 * intermediate, hidden]
        self.down = lin("down")  # [hidden, intermediate]


class LlamaModel:
    """Inference-only decoder of every family the loader reads (the name is historical).
    ``weights`` uses Baton's fused names (``loader._layout``)."""

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
        attention_backend: str = "auto", storage_dtype: torch.dtype | None = None,
        gemm_dtype: torch.dtype | None = None,
        quantized: dict[str, tuple[str, torch.Tensor]] | None = None,
        fp8_group: int | None = None, tp=None,
    ):
        """``weights`` are in the compute ``dtype``; ``storage_dtype`` (default: the same) is the
        precision they were rounded to, which the native small-M linear kernel reads;
        ``gemm_dtype`` (default: ``dtype``) the precision of BLAS matrix products. ``quantized``
        (``LoadedModel.quantized``): GGUF blocks whose values are exactly the float32 weights
        (before any rounding to ``storage_dtype``), which small batches read instead: as they
        are in a float32 engine, each weight rounded to bf16 in one with bf16 GEMMs.
        ``fp8_group``: an FP8 checkpoint's linear weights are kept FP8 (``name.scale`` beside
        each), with scales per row and this many columns (0: per row); Triton path only.
        ``tp`` (``baton.engine.tp.TPComm``): this is one rank of a tensor-parallel group;
        ``cfg`` is then the rank's share (``tp.local_config``) and ``weights`` its shard."""
        self.cfg = cfg
        self.tp = tp
        self.device = weights["embed"].device
        if self.device.type == "cuda" or attention_backend == "triton":
            self._init_triton(cfg, weights, dtype, attention_backend, fp8_group)
            return
        if fp8_group is not None:
            raise RuntimeError("FP8 weights need the Triton path (a CUDA device)")
        native = dtype == torch.float32 and cpu_attention.load() is not None
        if attention_backend == "native" and not native:
            raise RuntimeError("attention_backend='native' needs float32 compute and a C compiler")
        use_native = native and attention_backend in ("auto", "native")
        self.attention_backend = "native-cpu" if use_native else "torch"
        self.decode_attention = cpu_attention.decode_attention if use_native else decode_attention
        self.dtype = dtype
        small_linear = (dtype == torch.float32 and attention_backend != "torch"
                        and cpu_linear.load() is not None)
        small_dtype = (storage_dtype or dtype) if small_linear else None
        self.gemm_dtype = gemm_dtype or dtype
        self._init_linears(cfg, weights, quantized or {}, small_dtype)
        self._init_rope(cfg, weights, dtype)
        self._choose_cpu_kernels(cfg, dtype, attention_backend)

    def _init_rope(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> None:
        """cos/sin tables: the global ones, and (Gemma 3) the windowed layers' own base; the
        attention scale; the embedding scale in the embedding's dtype (as transformers rounds
        it)."""
        self.cos, self.sin = rope_tables(cfg, weights.get("rope_freqs"), dtype, self.device)
        self.rope = [(self.cos, self.sin)] * cfg.num_layers
        if cfg.local_rope_theta:
            local = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta,
                                        rope_scaling=RopeScaling())
            tables = rope_tables(local, None, dtype, self.device)
            self.rope = [tables if cfg.local_rope(i) else self.rope[i]
                         for i in range(cfg.num_layers)]
        self.scale = cfg.scale
        self.embed_scale = (None if cfg.embed_scale == 1.0 else
                            torch.tensor(cfg.embed_scale, dtype=self.embed.dtype,
                                         device=self.device))
        # the native fused paths compute a Llama layer; a layer with q/k norms, sandwich norms,
        # GeLU or a second RoPE base takes the general forward
        self.llama_layers = not (cfg.qk_norm or cfg.sandwich_norms or cfg.hidden_act != "silu"
                                 or cfg.local_rope_theta or cfg.moe_layers)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: [T, hidden] (float32 on CPU). Vocab-parallel under
        tensor parallelism: each rank's own rows, the others zero, summed over the group."""
        h = (F.embedding(input_ids, self.embed) if self.tp is None
             else self.tp.embed_rows(input_ids, self.embed))
        if self.embed_scale is not None:
            h = h * self.embed_scale
        h = h if self.device.type != "cpu" else h.float()
        return h if self.tp is None else self.tp.reduce(h)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """A row-parallel product summed over the group (itself without tensor parallelism)."""
        return t if self.tp is None else self.tp.reduce(t)

    def _row_add(self, h: torch.Tensor, lin, x: torch.Tensor) -> None:
        """``h += lin(x)``, summed over the group for a row-parallel ``lin``."""
        if self.tp is None:
            lin.add_to(h, x)
        else:
            h.add_(self.tp.reduce(lin(x)))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the final-normed rows ``h``, soft-capped where the model is (each
        rank's vocabulary rows gathered under tensor parallelism)."""
        logits = self.lm_head(h).float()
        if self.tp is not None:
            logits = self.tp.gather_logits(logits)
        cap = self.cfg.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def _init_linears(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                      quantized: dict, small_dtype: torch.dtype | None) -> None:
        """The embedding, the layers and the head, each linear with its BLAS, small-batch and
        GGUF-block forms (see :func:`make_linear`)."""
        gemm = self.gemm_dtype
        self.embed = weights["embed"]  # [vocab, hidden]
        # for BLAS stored transposed, [hidden, vocab]: x @ W^T with a tall W runs at half the
        # bandwidth on CPU BLAS, x @ W_t at full
        head = weights.get("lm_head", self.embed)
        head_blocks = quantized.get("lm_head" if "lm_head" in weights else "embed")
        self.lm_head = make_linear(head, None, small_dtype, gemm, transposed=True,
                                   blocks=head_blocks)
        self.norm = weights["norm"]
        self.layers = [
            Layer({k.split(".", 2)[2]: v for k, v in weights.items()
                   if k.startswith(f"layers.{i}.")}, small_dtype, gemm,
                  {k.split(".", 2)[2]: v for k, v in quantized.items()
                   if k.startswith(f"layers.{i}.")})
            for i in range(cfg.num_layers)
        ]

    def _choose_cpu_kernels(self, cfg: ModelConfig, dtype: torch.dtype,
                            attention_backend: str) -> None:
        """Which native CPU paths this model takes, from its dtypes, weights and this CPU."""
        gemm = self.gemm_dtype
        # prefill attention in the native flash kernel where this CPU runs it (AVX-512, and
        # AVX512-BF16 for bf16): 3x PyTorch's in bf16, 1.3-2x in float32 (kernels/csrc/
        # prefill_attention.c)
        self.prefill_native = (attention_backend in ("auto", "native")
                               and cpu_attention.prefill_supported(gemm, cfg.head_dim))
        # bf16 GEMMs on prepacked weights with a float32 residual: everything between them in
        # native one-pass kernels, bf16 in and out (see kernels/cpu_fused.py)
        self.fused_bf16 = (
            self.tp is None and self.llama_layers and dtype == torch.float32
            and gemm == torch.bfloat16
            and attention_backend != "torch"
            and cfg.head_dim <= cpu_fused.MAX_HEAD_DIM and cpu_fused.load() is not None
            and all(lin.packed is not None
                    and (lin.small is None or isinstance(lin.small, cpu_linear.QuantWeight))
                    and (lin.bias is None or lin is layer.qkv)
                    for layer in self.layers
                    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)))
        # float32 GEMMs: RMSNorm, RoPE and SiLU-and-multiply each in one native pass
        self.fused_f32 = (
            self.llama_layers and dtype == torch.float32 and gemm == torch.float32
            and attention_backend != "torch"
            and cfg.head_dim <= cpu_fused.MAX_HEAD_DIM and cpu_fused.load_f32() is not None)

    def _init_triton(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                     dtype: torch.dtype, attention_backend: str,
                     fp8_group: int | None = None) -> None:
        """On CUDA every matrix product is cuBLAS in ``dtype`` and everything else is a Triton
        kernel; the torch reference kernels stay on CPU, where the tests compare against them.
        On CPU this path runs only under Triton's interpreter (``TRITON_INTERPRET=1``, tests)."""
        if attention_backend not in ("auto", "triton"):
            raise RuntimeError(f"attention_backend={attention_backend!r} runs on CPU only; "
                               "on CUDA the engine uses triton")
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("attention_backend='triton' needs a CUDA device (or "
                               "TRITON_INTERPRET=1 to interpret the kernels on CPU)")
        from baton.kernels import triton_attention, triton_fused, triton_moe

        self._tri, self._fused, self._moe = triton_attention, triton_fused, triton_moe
        self.attention_backend = "triton"
        self.dtype = self.gemm_dtype = dtype
        self.embed = weights["embed"]
        self.lm_head = Linear(weights.get("lm_head", self.embed).contiguous(), None, None)
        self.norm = weights["norm"]
        self.layers = [
            Layer({k.split(".", 2)[2]: v for k, v in weights.items()
                   if k.startswith(f"layers.{i}.")}, None, dtype, pack=False,
                  fp8_group=fp8_group)
            for i in range(cfg.num_layers)
        ]
        self._init_rope(cfg, weights, dtype)
        # an FP8 KV cache's per-layer (key, value) scales: the checkpoint's where it has them
        # (``layers.i.kv_scale``), else 1 (keys and values within FP8's +-448 as they are)
        self.kv_scales = torch.stack([
            weights.get(f"layers.{i}.kv_scale", torch.ones(2)).float().to(self.device)
            for i in range(cfg.num_layers)]).contiguous()

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv: torch.Tensor, logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns float32 logits for ``logits_rows``: [N, vocab]."""
        if self.attention_backend == "triton":
            return self._forward_triton(input_ids, positions, meta, kv, logits_rows)
        if self.fused_bf16:
            return self._forward_fused_bf16(input_ids, positions, meta, kv, logits_rows)
        if self.fused_f32:
            return self._forward_fused_f32(input_ids, positions, meta, kv, logits_rows)
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        h = self._embed(input_ids)  # [T, hidden]: the residual, added in place
        rows = {id(c): (c[positions].unsqueeze(1), s[positions].unsqueeze(1))
                for c, s in self.rope}
        t = h.shape[0]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, eps)
            qkv = layer.qkv(x)
            qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
            qk = qk.view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                qk = qk_norm(qk, layer, cfg.num_heads, eps)
            # q and k heads rotate together: one set of rotary ops per layer instead of two
            qk = apply_rope(qk, *rows[id(self.rope[i][0])])
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
            store_kv(kv, i, meta.slot_blocks, meta.slot_offsets, k, v)
            o = self._attention(q, k, v, meta, kv, i).reshape(t, cfg.q_size)
            if layer.post_attn_norm is None:
                self._row_add(h, layer.o, o)  # h is this forward's own tensor
            else:
                h.add_(rms_norm(self._reduce(layer.o(o)), layer.post_attn_norm, eps))
            x = rms_norm(h, layer.mlp_norm, eps)
            if layer.router is not None:
                h.add_(self._reduce(moe(x, layer, cfg)))
                continue
            act = gate_mul(layer.gate_up(x), cfg.hidden_act)
            if layer.post_mlp_norm is None:
                self._row_add(h, layer.down, act)
            else:
                h.add_(rms_norm(self._reduce(layer.down(act)), layer.post_mlp_norm, eps))
        return self._logits(rms_norm(h[logits_rows], self.norm, eps))

    def _forward_fused_f32(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv: torch.Tensor, logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward` for float32 GEMMs with RMSNorm, RoPE and SiLU-and-multiply in native
        one-pass kernels (RoPE bit for bit torch's; the other two within float32 rounding). A
        1,000-token prefill on a 2-vCPU Zen 4 spent ~8% of its time in those torch ops."""
        cfg = self.cfg
        h = self._embed(input_ids)
        t, rotated = h.shape[0], cfg.num_heads + cfg.num_kv_heads
        for i, layer in enumerate(self.layers):
            x = cpu_fused.rms_norm_f32(h, layer.attn_norm, cfg.rms_norm_eps)
            qkv = cpu_fused.rope_f32_(layer.qkv(x), self.cos, self.sin, positions, rotated,
                                      cfg.head_dim).view(t, -1, cfg.head_dim)
            q, k, v = qkv.split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
            store_kv(kv, i, meta.slot_blocks, meta.slot_offsets, k, v)
            o = self._attention(q, k, v, meta, kv, i)
            self._row_add(h, layer.o, o.reshape(t, cfg.q_size))
            x = cpu_fused.rms_norm_f32(h, layer.mlp_norm, cfg.rms_norm_eps)
            self._row_add(h, layer.down, cpu_fused.silu_mul_f32(layer.gate_up(x)))
        return self._logits(rms_norm(h[logits_rows], self.norm, cfg.rms_norm_eps))

    def _forward_fused_bf16(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv: torch.Tensor, logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward` with bf16 activations between the GEMMs and the float32 residual
        ``h``: the same arithmetic as the float32 path with bf16 GEMMs (each GEMM input rounded
        once, float32 in between), less the copies and the chains of small ops. A 1,024-token
        prefill on one thread of a 2-vCPU AMX Xeon: 0.73 -> 0.39 s, where before the copies and
        elementwise ops took longer than the GEMMs."""
        cfg = self.cfg
        h = self._embed(input_ids)
        t, rotated = h.shape[0], cfg.num_heads + cfg.num_kv_heads
        for i, layer in enumerate(self.layers):
            x = cpu_fused.rms_norm_bf16(h, layer.attn_norm, cfg.rms_norm_eps)
            qkv, qf = cpu_fused.rope_bf16(layer.qkv.product(x), layer.qkv.bias, self.cos,
                                          self.sin, positions, rotated, cfg.head_dim,
                                          cfg.num_heads if meta.num_decodes else 0)
            q, k, v = qkv.split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
            store_kv(kv, i, meta.slot_blocks, meta.slot_offsets, k, v)
            o = self._attention(q, k, v, meta, kv, i, qf)
            h.add_(layer.o.product(o.reshape(t, cfg.q_size)))
            x = cpu_fused.rms_norm_bf16(h, layer.mlp_norm, cfg.rms_norm_eps)
            h.add_(layer.down.product(cpu_fused.silu_mul_bf16(layer.gate_up.product(x))))
        return self._logits(rms_norm(h[logits_rows], self.norm, cfg.rms_norm_eps))

    def _forward_triton(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv: torch.Tensor, logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The CUDA forward: per layer, add+RMSNorm, qkv GEMM, rope+KV store, attention, o GEMM,
        add+RMSNorm, gate/up GEMM, silu*mul, down GEMM (the residual add is folded into the
        next norm). No value is read back to the host, so decode can run in a CUDA graph."""
        cfg, fused, eps = self.cfg, self._fused, self.cfg.rms_norm_eps
        h = self._embed(input_ids)  # [T, hidden], the residual stream (in place)
        t, qk_cols = h.shape[0], cfg.q_size + cfg.kv_size
        x = fused.add_rms_norm(h, None, self.layers[0].attn_norm, eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            if layer.q_norm is not None:  # in place, before the rotation
                heads = qkv[:, :qk_cols].view(t, -1, cfg.head_dim)
                heads.copy_(qk_norm(heads, layer, cfg.num_heads, eps))
            q = fused.rope_store_kv(qkv, positions, *self.rope[i], kv, i, meta.slot_blocks,
                                    meta.slot_offsets, cfg.num_heads, kv_scales=self.kv_scales)
            o = self._reduce(layer.o(self._attention_triton(q, meta, kv, i).view(t, cfg.q_size)))
            if layer.post_attn_norm is not None:
                o = fused.add_rms_norm(o, None, layer.post_attn_norm, eps)
            x = fused.add_rms_norm(h, o, layer.mlp_norm, eps)
            mlp = self._reduce(self._mlp_triton(x, layer))
            if layer.post_mlp_norm is not None:
                mlp = fused.add_rms_norm(mlp, None, layer.post_mlp_norm, eps)
            if i + 1 < len(self.layers):
                x = fused.add_rms_norm(h, mlp, self.layers[i + 1].attn_norm, eps)
            else:
                h += mlp
        return self._logits(fused.add_rms_norm(h[logits_rows], None, self.norm, eps))

    def _mlp_triton(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        """The MLP of the normed rows ``x`` on CUDA: SwiGLU's fused kernel, GeLU in torch, or
        the experts in one grouped Triton GEMM per projection."""
        cfg = self.cfg
        if layer.router is not None:
            return self._moe.moe(x, *route(x, layer.router, cfg), layer.experts_gate_up,
                                 layer.experts_down, lambda g: gate_mul(g, cfg.hidden_act),
                                 fp8=layer.experts_fp8)
        gate_up = layer.gate_up(x)
        return layer.down(self._fused.silu_mul(gate_up) if cfg.hidden_act == "silu"
                          else gate_mul(gate_up, cfg.hidden_act))

    def _attention_triton(self, q: torch.Tensor, meta: AttentionMetadata, kv: torch.Tensor,
                          layer: int) -> torch.Tensor:
        tri, window, scales = self._tri, self.cfg.window(layer), self.kv_scales
        if meta.num_decodes and meta.decode_rows is None:  # pure decode batch
            return tri.decode_attention(q, kv, layer, meta.decode_block_tables,
                                        meta.decode_context_lens, self.scale,
                                        meta.decode_splits, window=window, kv_scales=scales)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[meta.decode_rows] = tri.decode_attention(
                q[meta.decode_rows], kv, layer, meta.decode_block_tables,
                meta.decode_context_lens, self.scale, meta.decode_splits, window=window,
                kv_scales=scales)
        if meta.prefill_starts is not None:
            tri.prefill_attention(q, kv, layer, meta.prefill_block_tables, meta.prefill_starts,
                                  meta.prefill_lens, meta.prefill_past, meta.max_prefill_len,
                                  self.scale, out=out, window=window, kv_scales=scales)
        return out

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        kv: torch.Tensor, layer: int, q_float: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of every row of ``q``: float32, or bf16 on the fused path, where the result
        is bf16 too and ``q_float`` holds the same queries unrounded for decode attention."""
        qd = q if q_float is None else q_float
        window = self.cfg.window(layer)  # 0, or a sliding-window layer's keys per query
        if meta.num_decodes and meta.decode_rows is None:  # pure decode batch
            return self.decode_attention(qd, kv, layer, meta.decode_block_tables,
                                         meta.decode_context_lens, self.scale,
                                         window).to(q.dtype)
        out = torch.empty(q.shape, dtype=q.dtype)  # contiguous: the prefill kernel writes rows
        if meta.num_decodes:
            out[meta.decode_rows] = self.decode_attention(
                qd[meta.decode_rows], kv, layer, meta.decode_block_tables,
                meta.decode_context_lens, self.scale, window).to(q.dtype)
        for p in meta.prefills:
            rows = slice(p.start, p.start + p.n)
            if p.num_past == 0:  # nothing cached before: attend to the fresh keys directly
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = gather_kv(kv, layer, p.block_table, self.gemm_dtype)
                ks, vs = ks[: p.num_past + p.n], vs[: p.num_past + p.n]
            pd = self.gemm_dtype  # bf16 where the GEMMs are: 2.6x faster on AMX
            args = (q[rows].to(pd), ks.to(pd), vs.to(pd), p.num_past, self.scale, window)
            if self.prefill_native:  # writes the rows of out in its dtype
                cpu_attention.prefill_attention(*args, out=out[rows])
            else:  # the assignment widens a bf16 result to float32 in the one copy it makes
                out[rows] = prefill_attention(*args)
        return out
