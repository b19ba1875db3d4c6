"""`baton profile --device cuda` on a GPU, at tensor-parallel size 1 and 2 (both ranks on one
GPU, gloo through the host), then `baton tune` on the two profiles: the costs the tuner
simulates come from the device the workers run on, each pool at its own TP size.

A SmolLM2-135M-sized random Llama (built with transformers' config class, no download), bf16,
the engine only (``--no-handoff``: the hand-off and serving-factor measurements need NIXL and a
Redis server, which the lent GPU machine lacks). Checks that each profile records its device and
TP size, that the tuner names them, then writes bench/results/gpu-profile-*.json (and a copy under
``--out-dir``).

    python bench/gpu_profile.py [--device cuda] [--out-dir DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baton.bench.common import machine, write_result

# SmolLM2-135M's depth and widths, with 8 heads of 64 and 2 KV heads (its 9 and 3 do not split
# at TP 2: the engine refuses them by name)
SMOL = dict(vocab_size=400, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)


def baton(*args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "baton.cli.main", *args], capture_output=True,
                         text=True, timeout=timeout)
    return out, time.monotonic() - t0


def trace(path: Path, n: int = 200) -> None:
    """A Baton-format workload: shared 512-token system prompts, own suffixes, 2 req/s."""
    rng, t = random.Random(0), 0.0
    with open(path, "w") as f:
        for i in range(n):
            t += rng.expovariate(2.0)
            sys_blocks = list(range((i % 4) * 32, (i % 4) * 32 + 32))
            f.write(json.dumps({"at": t, "prompt_tokens": 512 + rng.randint(64, 1024),
                                "output_tokens": rng.randint(32, 256), "blocks": sys_blocks,
                                "block_tokens": 16}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", default="3")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--shape", default="smol", choices=["smol", "tiny"],
                    help="tiny: the tests' 3-layer model (a quick check on a CPU)")
    a = ap.parse_args()
    from baton.bench.tiny_model import make_hf_model
    from baton.control.profile import CostModel, Profile

    work = Path(tempfile.mkdtemp(prefix="baton-gpu-profile-"))
    checks, runs = [], {}
    try:
        make_hf_model(work / "model", "llama", **(SMOL if a.shape == "smol" else {}))
        for tp in (1, 2):
            dev = a.device if tp == 1 or a.device == "cpu" else f"{a.device.split(':')[0]}:0"
            out_path = work / f"profile-tp{tp}.json"
            res, wall = baton("profile", "--device", dev, "--tensor-parallel-size", str(tp),
                              "--no-handoff", "--model", str(work / "model"), "--dtype",
                              "bfloat16", "--repeats", a.repeats, "--out", str(out_path))
            runs[f"profile_tp{tp}"] = {"command": res.args, "rc": res.returncode,
                                       "wall_s": wall, "stderr_tail": res.stderr[-3000:]}
            print(res.stderr[-1500:], file=sys.stderr)
            if res.returncode != 0:
                checks.append((f"profile TP{tp} ran", False))
                continue
            p = Profile.load(out_path)
            runs[f"profile_tp{tp}"].update(profile=json.loads(out_path.read_text()),
                                           cost_model=CostModel(p).summary())
            checks.append((f"profile TP{tp} records device {dev} and TP {tp}",
                           p.device == dev and p.tensor_parallel_size == tp))
        trace(work / "trace.jsonl")
        if all(ok for _, ok in checks):
            res, wall = baton("tune", "--trace", str(work / "trace.jsonl"), "--ttft-slo", "0.5",
                              "--tpot-slo", "0.03", "--profile", str(work / "profile-tp1.json"),
                              "--tp-profile", str(work / "profile-tp2.json"), "--decode-tp", "2",
                              "--requests", "200", "--max-input", "2048", "--no-plot",
                              "--out", str(work / "tune"))
            runs["tune"] = {"command": res.args, "rc": res.returncode, "wall_s": wall,
                            "stdout": res.stdout, "stderr_tail": res.stderr[-2000:]}
            print(res.stdout, file=sys.stderr)
            dev_kind = a.device.split(":")[0]
            checks.append(("tune names the profiles' device and TP sizes",
                           f"costs measured on {dev_kind}" in res.stderr
                           and "TP [1, 2]" in res.stderr))
            checks.append(("tune simulated the TP2 decode pool",
                           res.returncode == 0 and "1P(TP1)+1D(TP2)" in res.stdout))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"machine": machine(), "device": a.device, "model_shape": a.shape,
              "checks": [{"check": c, "ok": ok} for c, ok in checks], "runs": runs}
    path = write_result(f"gpu-profile-{a.device.split(':')[0]}", result)
    if a.out_dir:
        shutil.copy(path, Path(a.out_dir) / path.name)
    for c, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {c}")
    print(f"wrote {path}")
    return 0 if checks and all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
