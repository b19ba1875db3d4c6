"""The Triton attention, grouped-expert and FP8 kernels compile for an H100 (sm_90: TTIR -> PTX
-> cubin, with the bundled ptxas) on a machine without a GPU: code generation the interpreter
does not exercise (runtime branches on the sliding window, FP8 tensor-core dots and conversions)
is checked in CI, not first on a GPU."""

import importlib.util
import os
import subprocess
import sys

import pytest

# not imported here: Triton fixes its interpreter mode at import, and the kernel tests that
# share this process set TRITON_INTERPRET=1 before they import it
pytestmark = [pytest.mark.slow,  # ~15 s of compilation
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed")]

COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from baton.kernels import triton_attention as ta
from baton.kernels import triton_fp8 as tf
from baton.kernels import triton_fused as tu
from baton.kernels import triton_moe as tm


def signature(fn, pointers, consts):
    return {p: "constexpr" if p in consts else pointers.get(p, "fp32" if p == "scale" else "i32")
            for p in inspect.signature(fn.fn).parameters}


kv = "*bf16"
decode = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64,
              DIRECT=True, PRECISION="ieee", KV_FP8=False)
prefill = dict(GROUP=4, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=128,
               PRECISION="ieee", KV_FP8=False)
moe = dict(SCALE=True, FP8=False, GROUP=64, BLOCK_M=tm.BLOCK_M, BLOCK_N=64, BLOCK_K=64,
           PRECISION="tf32")
rope = dict(HQ=32, HKV=8, HQ_PAD=32, HKV_PAD=8, HALF=64, HALF_PAD=64, KV_FP8=True,
            INTERPRETED=False)
ints = ("bt_ptr", "ctx_ptr", "qstart_ptr", "qlen_ptr", "past_ptr")
pointers = {**{p: kv for p in ("q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "a_ptr", "w_ptr", "c_ptr",
                               "kvs_ptr", "qkv_ptr", "cos_ptr", "sin_ptr", "x_ptr", "bias_ptr")},
            **{p: "*i32" for p in ints}, "pacc_ptr": "*fp32", "pml_ptr": "*fp32",
            "pair_ptr": "*i64", "expert_ptr": "*i64", "scale_ptr": "*fp32", "as_ptr": "*fp32",
            "ws_ptr": "*fp32", "pos_ptr": "*i64", "blk_ptr": "*i64", "off_ptr": "*i64",
            "s_ptr": "*fp32"}
fp8_kv = {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "kvs_ptr": "*fp32"}
fp8_ab = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv"}
cases = (  # (kernel, constexprs, pointer types other than the defaults)
    (ta._decode_kernel, decode, {}), (ta._prefill_kernel, prefill, {}),
    (tm._grouped_gemm, moe, {}),
    # FP8: a KV cache the attention kernels read and the rope kernel writes; the FP8 GEMMs
    (ta._decode_kernel, {**decode, "KV_FP8": True}, fp8_kv),
    (ta._prefill_kernel, {**prefill, "KV_FP8": True}, fp8_kv),
    (tu._rope_store_kernel, rope, fp8_kv),
    (tm._grouped_gemm, {**moe, "FP8": True, "GROUP": 128}, fp8_ab),
    (tf._matmul, dict(GROUP=128, HAS_BIAS=True, BLOCK_M=tf.BLOCK_M, BLOCK_N=tf.BLOCK_N,
                      BLOCK_K=128), fp8_ab),
    (tf._quantize_rows, dict(GROUP=128, BLOCK=128, FP8_MAX=448.0, INTERPRETED=False),
     {"q_ptr": "*fp8e4nv"}),
    # the narrowest K tiles the FP8 kernels use (an FP8 dot of 16 does not compile for sm_90)
    (tm._grouped_gemm, {**moe, "FP8": True, "GROUP": 32, "BLOCK_K": tf.MIN_BLOCK_K}, fp8_ab),
    (tf._matmul, dict(GROUP=32, HAS_BIAS=False, BLOCK_M=tf.BLOCK_M, BLOCK_N=tf.BLOCK_N,
                      BLOCK_K=tf.MIN_BLOCK_K), fp8_ab),
)
for fn, consts, types in cases:
    k = triton.compile(ASTSource(fn, signature(fn, {**pointers, **types}, consts),
                                 constexprs=consts), target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"], fn
    print("compiled", fn.fn.__name__)
"""


def test_attention_moe_and_fp8_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[1::2] == [
        "_decode_kernel", "_prefill_kernel", "_grouped_gemm", "_decode_kernel", "_prefill_kernel",
        "_rope_store_kernel", "_grouped_gemm", "_matmul", "_quantize_rows", "_grouped_gemm",
        "_matmul"]
