"""FP8 checkpoints: the two layouts Baton reads, and their weights dequantized.

- ``quant_method: fp8`` (the official Qwen3 FP8 releases, DeepSeek's format): float8_e4m3fn
  weights with ``weight_scale_inv`` per ``weight_block_size`` block (128x128), or one per tensor.
- ``quant_method: compressed-tensors`` with 8-bit float weights (``format: float-quantized``):
  ``weight_scale`` per output channel ([N, 1]) or per tensor; an ``input_scale`` for static
  activation quantization may be present.

The engine dequantizes them to its compute dtype as they are loaded (``weight * scale`` in
float32, block by block), and says so: the values are the checkpoint's, the arithmetic is the
engine's (no FP8 matmul, activations unquantized). Anything else in a ``quantization_config`` is
refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from baton.engine.errors import UnsupportedModelError

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
