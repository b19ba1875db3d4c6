"""Native one-pass elementwise kernels between GEMMs, with ctypes: ``csrc/fused_bf16.c`` for bf16
GEMMs, ``csrc/fused_f32.c`` for float32 ones.

bf16: used by the CPU model when its GEMMs run in bf16 (``LlamaModel`` with ``gemm_dtype``
bfloat16 and prepacked weights): RMSNorm straight to the GEMM's bf16 input, RoPE on the QKV GEMM's
bf16 output, and SiLU-and-multiply on the gate/up GEMM's bf16 output. Each replaces a float32
round trip and a chain of torch ops with one read and one write; the arithmetic is float32 with
one rounding to bf16, as before.

float32: the same three steps, float32 in and out, each one pass instead of up to five torch ops
(``LlamaModel.fused_f32``). :func:`load` and :func:`load_f32` return ``None`` without a compiler
or with ``BATON_NATIVE=0``.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from baton.kernels import native

MAX_HEAD_DIM = 512  # the RoPE kernel's per-head scratch


i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _declare(dll: ctypes.CDLL | None, suffix: str, rope_args: list) -> ctypes.CDLL | None:
    """Argument types of a kernel library's three functions (``*_<suffix>``)."""
    if dll is None:
        return None
    for name, args in (
        ("rms_norm", [ptr] * 3 + [i64] * 2 + [ctypes.c_float, c_int]),
        ("silu_mul", [ptr] * 2 + [i64] * 2 + [c_int]),
        ("rope", rope_args),
    ):
        fn = getattr(dll, f"{name}_{suffix}")
        fn.restype, fn.argtypes = c_int, args
    return dll


@cache
def load() -> ctypes.CDLL | None:
    # -ffast-math without -fno-finite-math-only: glibc declares its vector expf (libmvec) only
    # then, and SiLU's exp is the one costly operation here (1,024 x 1,536 on one AMX Xeon
    # thread: 5.5 ms with scalar expf, 0.9 ms vectorized at 512 bits)
    dll = native.build("fused_bf16", ["-fopenmp", "-ffast-math", "-mprefer-vector-width=512",
                                      "-lmvec", "-lm"])
    return _declare(dll, "bf16", [ptr] * 2 + [i64] + [ptr] * 5 + [i64] * 4 + [c_int])


def _dll() -> ctypes.CDLL:
    dll = load()
    assert dll is not None, "native kernels are off or could not be built"
    return dll


def _rms_norm(fn, x: torch.Tensor, weight: torch.Tensor, eps: float,
              dtype: torch.dtype) -> torch.Tensor:
    assert x.dtype == weight.dtype == torch.float32 and x.dim() == 2, (x.dtype, weight.dtype)
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    fn(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps,
       torch.get_num_threads())
    return out


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 ``x`` [T, H] with float32 ``weight`` [H], rounded to bf16 [T, H]."""
    return _rms_norm(_dll().rms_norm_bf16, x, weight, eps, torch.bfloat16)


def _silu_mul(fn, gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    assert gate_up.dtype == dtype and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
    gate_up = gate_up.contiguous()
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=dtype)
    fn(out.data_ptr(), gate_up.data_ptr(), t, inter, torch.get_num_threads())
    return out


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a bf16 [T, 2I] tensor holding [gate | up]: bf16 [T, I]."""
    return _silu_mul(_dll().silu_mul_bf16, gate_up, torch.bfloat16)


def rope_bf16(qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor, rotated_heads: int, head_dim: int,
              float_queries: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """bf16 ``qkv`` [T, (rotated + value heads) * D], plus float32 ``bias`` if given, with the
    first ``rotated_heads`` heads rotated (rotate-half rule) at ``positions`` [T] and the rest
    copied: bf16 [T, heads, D]. ``cos``, ``sin``: float32 [max_position, D]. With
    ``float_queries`` = Hq, also the first Hq rotated heads in float32 [T, Hq, D], unrounded
    (else ``None``)."""
    t, width = qkv.shape
    assert qkv.dtype == torch.bfloat16 and width % head_dim == 0 and head_dim % 2 == 0
    assert head_dim <= MAX_HEAD_DIM and cos.dtype == sin.dtype == torch.float32
    assert cos.shape[1] == head_dim and positions.shape == (t,)
    assert 0 <= float_queries <= rotated_heads
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.shape == (width,)
        bias = bias.contiguous()
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    pos = positions.to(torch.int64).contiguous()
    heads = width // head_dim
    out = torch.empty(t, heads, head_dim, dtype=torch.bfloat16)
    qf = torch.empty(t, float_queries, head_dim) if float_queries else None
    _dll().rope_bf16(out.data_ptr(), None if qf is None else qf.data_ptr(), float_queries,
                     qkv.data_ptr(), None if bias is None else bias.data_ptr(),
                     cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), t, rotated_heads,
                     heads - rotated_heads, head_dim, torch.get_num_threads())
    return out, qf


# ------------------------------------------------------------------------------------------------
# float32 engines (csrc/fused_f32.c): the same three steps, float32 in and out
# ------------------------------------------------------------------------------------------------


@cache
def load_f32() -> ctypes.CDLL | None:
    # no -ffast-math and no contraction: RoPE must round as torch does (see the C file)
    dll = native.build("fused_f32", ["-fopenmp", "-ffp-contract=off", "-lmvec", "-lm"])
    return _declare(dll, "f32", [ptr] * 4 + [i64] * 4 + [c_int])


def _dll_f32() -> ctypes.CDLL:
    dll = load_f32()
    assert dll is not None, "native kernels are off or could not be built"
    return dll


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 ``x`` [T, H] with float32 ``weight`` [H]: float32 [T, H]."""
    return _rms_norm(_dll_f32().rms_norm_f32, x, weight, eps, torch.float32)


def silu_mul_f32(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a float32 [T, 2I] tensor holding [gate | up]: float32 [T, I]."""
    return _silu_mul(_dll_f32().silu_mul_f32, gate_up, torch.float32)


def rope_f32_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              rotated_heads: int, head_dim: int) -> torch.Tensor:
    """Rotates the first ``rotated_heads`` heads of each row of float32 ``qkv`` [T, W] in place
    (rotate-half rule, at ``positions`` [T]; ``cos``, ``sin``: float32 [max_position, D]) and
    returns it: the same values as :func:`baton.engine.model.apply_rope`, bit for bit."""
    t, width = qkv.shape
    assert qkv.dtype == torch.float32 and qkv.is_contiguous() and head_dim % 2 == 0
    assert head_dim <= MAX_HEAD_DIM and rotated_heads * head_dim <= width
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[1] == head_dim
    assert positions.shape == (t,)
    cos, sin = cos.contiguous(), sin.contiguous()
    pos = positions.to(torch.int64).contiguous()
    _dll_f32().rope_f32(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), t, width,
                        rotated_heads, head_dim, torch.get_num_threads())
    return qkv
