"""FP8 checkpoints: the two layouts Baton reads, and their weights dequantized.

- ``quant_method: fp8`` (the official Qwen3 FP8 releases, DeepSeek's format): float8_e4m3fn
  weights with ``weight_scale_inv`` per ``weight_block_size`` block (128x128), or one per tensor.
- ``quant_method: compressed-tensors`` with 8-bit float weights (``format: float-quantized``):
  ``weight_scale`` per output channel ([N, 1]) or per tensor; an ``input_scale`` for static
  activation quantization may be present.

On a GPU with FP8 tensor cores (sm_89+), and under Triton's interpreter in the tests, the
weights stay FP8 with their scales as per-row group scales (:func:`expand_scale`) and every
linear layer is an FP8 matmul with activations quantized per token (and per 128-column group for
block scales): ``baton.kernels.triton_fp8``. Elsewhere (CPU, older GPUs) the engine dequantizes
them to its compute dtype as they are loaded (``weight * scale`` in float32, block by block), and
says so: the values are the checkpoint's, the arithmetic is the engine's (activations
unquantized). A static ``input_scale`` is not used: activations are always scaled dynamically.
Anything else in a ``quantization_config`` is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from baton.engine.errors import UnsupportedModelError
from baton.kernels.fp8_layout import groups

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # fp8 | compressed-tensors
    strategy: str  # block | channel | tensor
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        shape = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.method} ({self.strategy}{shape} scales)"


def _refuse(field: str, value, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config field quantization_config.{field}={value!r}: {why}; "
                                 "Baton refuses a model it would not compute exactly")


def scheme(qc: dict) -> Fp8Scheme:
    """The FP8 scheme ``qc`` (a config's ``quantization_config``) describes, or an
    UnsupportedModelError naming the field Baton does not read."""
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _refuse("fmt", qc.get("fmt"), "only e4m3 FP8 is read")
        block = qc.get("weight_block_size")
        if block is None:
            return Fp8Scheme("fp8", "tensor")
        if len(block) != 2 or min(block) < 1:
            raise _refuse("weight_block_size", block, "two positive sizes expected")
        return Fp8Scheme("fp8", "block", (int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _refuse("quant_method", method, "Baton reads FP8 checkpoints only (quant_method fp8, "
                  "or compressed-tensors with 8-bit float weights)")


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    if qc.get("format") not in ("float-quantized", None):
        raise _refuse("format", qc.get("format"), "only float-quantized (FP8) is read")
    strategies = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise _refuse(f"config_groups.{name}.weights", w, "only 8-bit float weights are read")
        if w.get("strategy") not in ("channel", "tensor"):
            raise _refuse(f"config_groups.{name}.weights.strategy", w.get("strategy"),
                          "channel or tensor scales are read")
        if w.get("dynamic"):
            raise _refuse(f"config_groups.{name}.weights.dynamic", True, "weights need scales")
        strategies.add(w["strategy"])
    if len(strategies) != 1:
        raise _refuse("config_groups", sorted(strategies), "one weight strategy expected")
    return Fp8Scheme("compressed-tensors", strategies.pop())


def dequantize(w: torch.Tensor, scale: torch.Tensor, s: Fp8Scheme) -> torch.Tensor:
    """float32 ``w * scale``: a per-block scale covers its block of rows and columns (the last
    blocks may be partial), a per-channel one its row, a per-tensor one everything."""
    out = w.float()
    scale = scale.float()
    if s.strategy == "block":
        bn, bk = s.block
        n, k = out.shape
        grid = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != grid:
            raise UnsupportedModelError(f"block scales of shape {tuple(scale.shape)} for a "
                                        f"{n}x{k} weight in {bn}x{bk} blocks (expected {grid})")
        scale = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif s.strategy == "channel":
        scale = scale.reshape(-1, 1)
    else:
        scale = scale.reshape(())
    return out * scale


def expand_scale(scale: torch.Tensor, rows: int, k: int, block: tuple[int, int] | None
                 ) -> torch.Tensor:
    """A checkpoint's scale for a [rows, K] weight as float32 [rows, G] per-row group scales:
    a block scale [ceil(rows / bn), ceil(K / bk)] repeated over its rows, a per-channel one
    [rows, 1] as it is, a per-tensor one on every row. Fused weights stack their parts' rows."""
    scale = scale.float()
    if block is not None:
        return scale.repeat_interleave(block[0], 0)[:rows].reshape(rows, groups(k, block[1]))
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    return scale.reshape(rows, 1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 values of an FP8 weight [..., N, K] kept with per-row group scales [..., N, G]."""
    k = q.shape[-1]
    cols = torch.arange(k, device=q.device) // (k if scale.shape[-1] == 1 else group)
    return q.float() * scale[..., cols]
