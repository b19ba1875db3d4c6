"""Native CPU paged decode attention (``csrc/paged_decode_attention.c``), loaded with ctypes.

The torch reference (:func:`baton.kernels.paged_attention.decode_attention`) gathers every
sequence's blocks into a padded copy before attending; on a CPU, where decode attention is bound
by memory bandwidth, the copy costs more than the attention. This kernel reads the blocks in place.

It is compiled once with the system C compiler into ``$BATON_CACHE_DIR/kernels`` (about a second)
and cached by source hash. Without a compiler, :func:`load` returns ``None`` and the engine uses the
torch reference; the backend in use is reported by ``LLMEngine.attention_backend``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import torch

SRC = Path(__file__).with_name("csrc") / "paged_decode_attention.c"


@cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("BATON_NATIVE_ATTENTION", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    src = SRC.read_bytes()
    tag = hashlib.sha256(src + cc.encode()).hexdigest()[:16]
    root = Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))
    lib = root / "kernels" / f"paged_decode_attention-{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, "-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC",
               "-o", str(tmp), str(SRC), "-lpthread", "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"[baton] native attention kernel failed to compile, using torch:\n{r.stderr}",
                  file=sys.stderr)
            return None
        tmp.rename(lib)
    dll = ctypes.CDLL(str(lib))
    dll.paged_decode_attention.restype = ctypes.c_int
    dll.paged_decode_attention.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 8
        + [ctypes.c_float, ctypes.c_int])
    return dll


def decode_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Same contract as the torch reference: q [B, Hq, D] float32 -> [B, Hq, D]."""
    dll = load()
    assert dll is not None
    nb, num_layers, two, bs, hkv, d = kv.shape
    b, hq, dq = q.shape
    assert two == 2 and dq == d and hq % hkv == 0, (q.shape, kv.shape)
    assert kv.is_contiguous() and kv.dtype in (torch.float32, torch.bfloat16), kv.dtype
    assert q.dtype == torch.float32 and block_tables.dtype == torch.int64
    assert block_tables.shape[0] == b and context_lens.shape == (b,)
    q = q.contiguous()
    bt = block_tables.contiguous()
    lens = context_lens.contiguous()
    out = torch.empty_like(q)
    rc = dll.paged_decode_attention(
        out.data_ptr(), q.data_ptr(), kv.data_ptr(), int(kv.dtype == torch.bfloat16),
        bt.data_ptr(), lens.data_ptr(), b, bt.shape[1], layer, num_layers, bs, hkv, hq // hkv, d,
        scale, torch.get_num_threads())
    assert rc == 0, f"unsupported shape for the native kernel: group={hq // hkv} dim={d} bs={bs}"
    return out
