#!/usr/bin/env python3
"""Tensor parallelism on one GPU: correctness first, then the TP-mismatched VRAM hand-off.

    python -m baton.bench.gpu_tp [--device cuda:0] [--out DIR] [--skip-transfer]

1. engine: tiny random checkpoints (Qwen2 with a sliding window and 4 KV heads, Qwen3 with one
   KV head replicated over the ranks, Qwen3-MoE) in float32 on the device: greedy tokens of an
   engine at tensor-parallel size 2 (two rank processes on the one GPU sharing one KV pool by
   CUDA IPC, collectives over gloo through the host; CUDA graphs off at TP > 1) equal to size 1
   (CUDA graphs on).
2. transfer: ``bench/tp_transfer.py --device cuda``: an 8B-shaped 2,000-token hand-off between
   VRAM pools of every layout pair (NIXL, UCX cuda_ipc between two processes on the GPU), as a
   fraction of a device-to-device copy of the same bytes (target: >= 0.5).

NCCL and graph-captured all-reduce are not exercised (one GPU). Writes gpu-tp-*.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baton.bench.common import machine

KINDS = ("qwen2", "qwen3", "qwen3_moe")
PROMPT = [(7 * i + 3) % 380 + 10 for i in range(37)]


def greedy(path: str, device: str, size: int, n: int = 16) -> tuple[list[int], float]:
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine.from_path(path, EngineConfig(tensor_parallel_size=size, device=device,
                                                    block_size=16, num_kv_blocks=64))
    try:
        out: list[int] = []
        engine.add_request(prompt_token_ids=PROMPT,
                           params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            for o in engine.step():
                out += o.new_token_ids
        engine.check_integrity()
        return out, time.perf_counter() - t0
    finally:
        engine.close()


def engine_part(device: str) -> dict:
    from baton.bench.tiny_model import TP_SHAPES, make_hf_model

    rows = {}
    root = Path(tempfile.mkdtemp(prefix="baton-gpu-tp-"))
    for kind in KINDS:
        path = root / kind
        make_hf_model(path, kind, **TP_SHAPES[kind])
        try:
            one, s1 = greedy(str(path), device, 1)
            two, s2 = greedy(str(path), device, 2)
            rows[kind] = {"tp1": one, "tp2": two, "equal": one == two, "tp1_s": s1, "tp2_s": s2}
        except Exception as e:  # noqa: BLE001 - report and go on to the next family
            rows[kind] = {"error": f"{type(e).__name__}: {e}"}
        print(f"engine {kind}: {rows[kind].get('equal', rows[kind].get('error'))}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return rows


def transfer_part(out_dir: Path) -> dict:
    here = Path(__file__).resolve().parent  # run as a module: bench/ holds a profile.py
    r = subprocess.run([sys.executable, "-m", "baton.bench.tp_transfer", "--device", "cuda"],
                       capture_output=True, text=True, timeout=400)
    print(r.stdout[-4000:], r.stderr[-2000:], flush=True)
    files = sorted(glob.glob(str(here / "results" / "tp-transfer-*.json")), key=os.path.getmtime)
    if r.returncode != 0 or not files:
        return {"error": f"exit {r.returncode}", "stderr": r.stderr[-3000:]}
    shutil.copy(files[-1], out_dir)
    return json.loads(Path(files[-1]).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--skip-transfer", action="store_true")
    a = ap.parse_args()
    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"bench": "gpu-tp", "machine": machine(), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
              "engine": engine_part(a.device)}
    if not a.skip_transfer:
        result["transfer"] = transfer_part(out)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = out / f"gpu-tp-{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for kind, r in result["engine"].items():
        print(f"{kind:<10} TP2 == TP1: {r.get('equal', r.get('error'))}")
    t = result.get("transfer", {})
    for p in t.get("pairs", []):
        print(f"{p['pair']:<24} {p['one_run']['read_s'] * 1e3:8.2f} ms  "
              f"{p['one_run']['of_copy']:.2f} of copy  scattered "
              f"{p['scattered']['of_copy']:.2f}")
    print(f"wrote {path}")
    return 0 if all(r.get("equal") for r in result["engine"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
