"""The Triton attention and grouped-expert kernels compile for an H100 (sm_90: TTIR -> PTX ->
cubin, with the bundled ptxas) on a machine without a GPU: code generation the interpreter does
not exercise (runtime branches on the sliding window, for one) is checked in CI, not first on a
GPU."""

import importlib.util
import os
import subprocess
import sys

import pytest

# not imported here: Triton fixes its interpreter mode at import, and the kernel tests that
# share this process set TRITON_INTERPRET=1 before they import it
pytestmark = [pytest.mark.slow,  # ~6 s of compilation
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed")]

COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from baton.kernels import triton_attention as ta
from baton.kernels import triton_moe as tm


def signature(fn, pointers, consts):
    return {p: "constexpr" if p in consts else pointers.get(p, "fp32" if p == "scale" else "i32")
            for p in inspect.signature(fn.fn).parameters}


kv = "*bf16"
decode = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64,
              DIRECT=True, PRECISION="ieee")
prefill = dict(GROUP=4, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=128,
               PRECISION="ieee")
moe = dict(SCALE=True, BLOCK_M=tm.BLOCK_M, BLOCK_N=64, BLOCK_K=64, PRECISION="tf32")
ints = ("bt_ptr", "ctx_ptr", "qstart_ptr", "qlen_ptr", "past_ptr")
pointers = {**{p: kv for p in ("q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "a_ptr", "w_ptr", "c_ptr")},
            **{p: "*i32" for p in ints}, "pacc_ptr": "*fp32", "pml_ptr": "*fp32",
            "pair_ptr": "*i64", "expert_ptr": "*i64", "scale_ptr": "*fp32"}
for fn, consts in ((ta._decode_kernel, decode), (ta._prefill_kernel, prefill),
                   (tm._grouped_gemm, moe)):
    k = triton.compile(ASTSource(fn, signature(fn, pointers, consts), constexprs=consts),
                       target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"], fn
    print("compiled", fn.fn.__name__)
"""


def test_attention_and_moe_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["compiled", "_decode_kernel", "compiled", "_prefill_kernel",
                                  "compiled", "_grouped_gemm"]
