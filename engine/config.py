"""Frozen configuration, layered: model -> engine. Derived values are properties."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field

import torch
from baton.engine.errors import InvalidRequestError

# Layout of the KV tensor, part of the model fingerprint (peers must agree on it).
KV_LAYOUT = "block-major:[num_blocks,num_layers,2,block_size,num_kv_heads,head_dim]"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling: ``none``, ``linear`` or ``llama3``."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a dense decoder: Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Gemma 3 text.

    Everything that changes the computation is a field here, so the model fingerprint (which
    peers must match to exchange KV blocks) names it: per-layer sliding windows, q/k norms, the
    attention scale, RoPE per layer type. Family defaults are the loader's business
    (``loader._hf_config``); a config field the engine does not compute exactly is refused
    there, never ignored."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # per layer, how many keys a query sees (itself included) where the layer slides a window;
    # 0: full causal attention. Empty: every layer full.
    layer_windows: tuple[int, ...] = ()
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm of q and k before RoPE
    # Gemma 3: RMSNorm after attention and after the MLP too (before each residual add)
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # silu | gelu_tanh: the MLP's gate activation
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float = 0.0  # 0: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    final_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap)
    # > 0: windowed layers' RoPE base, unscaled (Gemma 3's rope_local_base_freq)
    local_rope_theta: float = 0.0
    # mixture of experts (Mixtral, Qwen3-MoE): the layers whose MLP is ``num_experts`` experts
    # of ``moe_intermediate_size``, ``experts_per_token`` of them per token, chosen by softmax
    # over a router's logits and their weights renormalised to sum to 1 with ``norm_topk_prob``
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} "
                             "layers")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act={self.hidden_act!r}")

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees, itself included; 0: all before it."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with the local RoPE base (a windowed Gemma 3 layer)."""
        return self.local_rope_theta > 0 and self.window(layer) > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ModelConfig:
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["layer_windows"] = tuple(d.get("layer_windows", ()))
        d["moe_layers"] = tuple(d.get("moe_layers", ()))
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs a model.

    ``dtype`` is the precision of the weights and the KV cache. On CPU, activations are float32
    whatever ``dtype`` is: half-precision weights keep their rounded values, the native small-batch
    kernels read them at half the bytes, and the KV cache is stored in ``dtype``. Large matrix
    products (prefill, big decode batches) run in bfloat16 where the CPU does bf16 arithmetic in
    hardware (AMX, AVX512-BF16), and in float32 elsewhere: without it (AVX2 only) PyTorch's
    half-precision GEMMs are 5-10x slower than float32. ``compute_dtype`` and ``gemm_dtype``
    report what is used. With bf16 GEMMs on prepacked weights, what passes between them (the
    normalized GEMM inputs, the rotated queries and keys, the attention output, SiLU-and-multiply)
    is kept in bf16 by native one-pass kernels, each rounded once from float32 arithmetic: the
    residual stream and decode attention's queries stay float32 (``LlamaModel.fused_bf16``).
    """

    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    # auto | native (C kernels on CPU: paged decode attention, small-batch linear) | triton
    # (Triton kernels on CUDA) | torch (reference). auto: native on CPU, triton on CUDA.
    attention_backend: str = "auto"
    # on CUDA, decode steps of up to max_num_seqs sequences replay captured CUDA graphs
    cuda_graphs: bool = True
    # the KV pool records prefix-cache events (BlockPool.events) for the Redis prefix index
    record_kv_events: bool = False
    # on CUDA, without num_kv_blocks: the share of the device's memory this engine may use in
    # all (weights, activations, CUDA graphs, KV pool); the KV pool gets what is left
    # (``baton.engine.gpu_memory``). Ignored on CPU, where kv_cache_bytes sizes the pool.
    gpu_memory_utilization: float = 0.9
    # KV tiers under the pool (baton.engine.kv_tiers): evicted prefix blocks kept in host memory
    # (pinned on CUDA) and in one file under kv_disk_tier_dir; 0 turns a tier off
    kv_host_tier_bytes: int = 0
    kv_disk_tier_bytes: int = 0
    kv_disk_tier_dir: str | None = None
    # auto: the KV cache in ``dtype``; fp8: float8_e4m3fn with per-layer scales, read by the
    # Triton attention kernels (a CUDA device, or the interpreter in tests)
    kv_cache_dtype: str = "auto"
    # the KV pool's layout (engine/kv_layout.py): head (KV-head-major: hands off to and from
    # pools of any tensor-parallel size) | block (block-major: the fewest descriptors per
    # hand-off, but one rank only, and only to and from other block-major pools)
    kv_layout: str = "head"
    # ranks of this engine's tensor-parallel group (engine/tp.py); 1: no tensor parallelism
    tensor_parallel_size: int = 1
    # seconds a rank waits in one collective before its group is declared down
    tp_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequestError("dtype", self.dtype, f"must be one of {sorted(DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size", self.block_size, "must be a power of two")
        if self.max_num_batched_tokens < self.block_size:
            raise InvalidRequestError(
                "max_num_batched_tokens", self.max_num_batched_tokens, "must be >= block_size"
            )
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs", self.max_num_seqs, "must be >= 1")
        if self.attention_backend not in ("auto", "native", "triton", "torch"):
            raise InvalidRequestError("attention_backend", self.attention_backend,
                                      "must be auto, native, triton or torch")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise InvalidRequestError("device", self.device, "must be cpu, cuda or cuda:N")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError("gpu_memory_utilization", self.gpu_memory_utilization,
                                      "must be in (0, 1]")
        if self.kv_host_tier_bytes < 0 or self.kv_disk_tier_bytes < 0:
            raise InvalidRequestError("kv_tier_bytes", (self.kv_host_tier_bytes,
                                                        self.kv_disk_tier_bytes), "must be >= 0")
        if self.kv_disk_tier_bytes and not self.kv_disk_tier_dir:
            raise InvalidRequestError("kv_disk_tier_dir", self.kv_disk_tier_dir,
                                      "a disk tier needs a directory")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks", self.num_kv_blocks, "must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError("kv_cache_dtype", self.kv_cache_dtype,
                                      f"must be one of {sorted(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "fp8" and self.device == "cpu" and (
                self.attention_backend != "triton"):
            raise InvalidRequestError("kv_cache_dtype", "fp8", "an FP8 KV cache is read by the "
                                      "Triton attention kernels: it needs a CUDA device (the "
                                      "CPU kernels read float32 or bfloat16 KV)")

        self._check_tp()

    def _check_tp(self) -> None:
        if self.kv_layout not in ("head", "block"):
            raise InvalidRequestError("kv_layout", self.kv_layout, "must be head or block")
        if self.tensor_parallel_size < 1:
            raise InvalidRequestError("tensor_parallel_size", self.tensor_parallel_size,
                                      "must be >= 1")
        if self.tensor_parallel_size > 1 and self.kv_layout == "block":
            raise InvalidRequestError("kv_layout", "block", "a block-major pool holds one "
                                      "rank's heads; tensor parallelism needs kv_layout=head")
        if self.tensor_parallel_size > 1 and self.device == "cuda":
            raise InvalidRequestError(
                "device", "cuda", "a tensor-parallel group shares one KV pool, so all its ranks "
                "run on one device: name it (cuda:0); ranks on separate GPUs (per-rank pools) "
                "are not built yet")
        if self.tp_timeout_s <= 0:
            raise InvalidRequestError("tp_timeout_s", self.tp_timeout_s, "must be > 0")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @property
    def device_kind(self) -> str:
        """``cpu`` or ``cuda``: part of the model fingerprint (see :func:`model_fingerprint`)."""
        return device_kind(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activations' precision (and, off CPU, every operation's)."""
        return self.torch_dtype if self.device != "cpu" else torch.float32

    @property
    def gemm_dtype(self) -> torch.dtype:
        """Precision of the large matrix products (weights stored in ``dtype``)."""
        if self.device != "cpu":
            return self.torch_dtype
        if self.torch_dtype == torch.bfloat16 and cpu_has_native_half():
            return torch.bfloat16
        return torch.float32


@functools.cache
def cpu_has_native_half() -> bool:
    """True when the CPU does bf16 arithmetic in hardware (AVX512-BF16, AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def device_kind(device: str) -> str:
    """``cuda:1`` -> ``cuda``; ``cpu`` -> ``cpu``."""
    return device.split(":", 1)[0]


# the CPU instruction sets that set an engine step's time (bf16 matmuls in hardware, their width)
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")


def cpu_processor(model_name: str, flags) -> str:
    """A CPU as :func:`processor` names it: its model name and which :data:`SPEED_FLAGS` it
    has, ``"AMD EPYC (avx2 avx512f avx512_bf16 fma)"``."""
    return f"{model_name} ({' '.join(f for f in SPEED_FLAGS if f in flags)})"


def processor(device: str) -> str:
    """What computes on ``device``, by name, as a worker registers it and a profile records
    it: the GPU's name (``"NVIDIA H200"``), or the CPU's model name and speed flags (Linux
    /proc/cpuinfo); "" where neither can be read. Two machines of one name can still differ
    in speed (a VM's host), but two names are two machines' costs."""
    if device_kind(device) == "cuda":
        try:
            return torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError, ValueError):
            return ""
    from baton.kernels.native import cpu_flags

    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f
                         if ln.startswith("model name")), "")
    except OSError:
        return ""
    return cpu_processor(name, cpu_flags()) if name else ""


def model_fingerprint(cfg: ModelConfig, weights_id: str, dtype: str, block_size: int,
                      device: str = "cpu", *, fp8_matmul: bool = False,
                      kv_dtype: str = "auto") -> str:
    """Identity of (architecture, weights, dtype, block size, KV layout, device kind): peers
    must match it to exchange raw KV blocks.

    The device kind (``cpu``/``cuda``, not the index) is in it because the two engines compute
    different KV from the same prompt: on CPU activations are float32 whatever the storage
    dtype, on CUDA they are in the dtype, and the kernels round differently. A CPU pool and a GPU
    pool therefore never exchange blocks: a reader refuses the holder's handshake
    (FAILED_PRECONDITION) and the router serves such a pair by the local path. Which GPU a pool
    is on does not matter (blocks move between GPUs as bytes).

    FP8 matmuls (an FP8 checkpoint on a GPU that has them) compute other KV than the same
    checkpoint dequantized, and an FP8 KV cache holds other bytes than a bf16 one: each is in it
    where it is on (absent otherwise, so the fingerprints of other engines stay as they were)."""
    ident = {"model": cfg.to_json(), "weights": weights_id, "dtype": dtype,
             "block_size": block_size, "kv_layout": KV_LAYOUT, "device": device_kind(device)}
    if fp8_matmul:
        ident["matmul"] = "fp8"
    if kv_dtype != "auto":
        ident["kv_dtype"] = kv_dtype
    blob = json.dumps(ident, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
