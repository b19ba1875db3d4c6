"""Host memory of a model load: peak RSS above what the loaded weights themselves take.

Builds (once) a random checkpoint shaped like a ~1.5B Qwen2 (hidden 1536, 28 layers, vocabulary
151,936, bf16) in three safetensors shards, then loads it in fresh processes and reports, for each,
``peak RSS - RSS before the load - bytes of the loaded weights``: what the load held beside the
weights at its worst. The goal: at most the largest shard plus 1 GiB. ``--baseline SITE`` runs the
same load with another Baton build first (a ``pip install --target SITE`` of an older commit), in
the same run, for the before figure.

    python -m baton.bench.load_memory [--dir /tmp/baton-load-1.5b] [--baseline SITE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from baton.bench.common import machine, write_result

SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
             num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
SHARDS = 3
GOAL_SLACK = 1 << 30  # the goal: overhead <= largest shard + 1 GiB

# run in a fresh interpreter: RSS before, the load, peak RSS (ru_maxrss, KiB), weight bytes
PROBE = """
import json, resource, sys, torch
from baton.engine import loader
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
kw = {}
if sys.argv[2] != "source":
    kw["place"] = loader.Placement(getattr(torch, sys.argv[2]))
model = loader.load_model(sys.argv[1], **kw)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weights = sum(t.numel() * t.element_size() for t in model.weights.values())
print(json.dumps({"rss_before": before, "peak_rss": peak, "weight_bytes": weights,
                  "dtype": str(next(iter(model.weights.values())).dtype)}))
"""


def build(path: Path) -> list[int]:
    """The random checkpoint (skipped when present); returns the shard sizes in bytes."""
    import torch
    from baton.bench.tiny_model import write_tokenizer
    from safetensors.torch import save_file

    files = sorted(path.glob("*.safetensors"))
    if len(files) == SHARDS:
        return [f.stat().st_size for f in files]
    path.mkdir(parents=True, exist_ok=True)
    h, inter, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], 2 * 128
    layers = SHAPE["num_hidden_layers"]
    per = -(-layers // SHARDS)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).bfloat16()

    for s in range(SHARDS):
        t = {}
        if s == 0:
            t["model.embed_tokens.weight"] = rand(SHAPE["vocab_size"], h)
        for i in range(s * per, min(layers, (s + 1) * per)):
            p = f"model.layers.{i}."
            t.update({p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                      p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                      p + "self_attn.o_proj.weight": rand(h, h)})
            for name, rows in (("q", h), ("k", kv), ("v", kv)):
                t[p + f"self_attn.{name}_proj.weight"] = rand(rows, h)
                t[p + f"self_attn.{name}_proj.bias"] = rand(rows)
            t.update({p + "mlp.gate_proj.weight": rand(inter, h),
                      p + "mlp.up_proj.weight": rand(inter, h),
                      p + "mlp.down_proj.weight": rand(h, inter)})
        if s == SHARDS - 1:
            t["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        save_file(t, path / f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors")
        del t
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "bos_token_id": 0, "eos_token_id": 1, **SHAPE}))
    write_tokenizer(path)
    return [f.stat().st_size for f in sorted(path.glob("*.safetensors"))]


def probe(path: Path, dtype: str, site: str | None) -> dict:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROBE, str(path), dtype], env=env, check=True,
                         capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["overhead"] = r["peak_rss"] - r["rss_before"] - r["weight_bytes"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/baton-load-1.5b", help="where the checkpoint lives")
    ap.add_argument("--baseline", help="a pip --target install of another Baton build")
    a = ap.parse_args()
    path = Path(a.dir)
    shards = build(path)
    budget = max(shards) + GOAL_SLACK
    runs = []
    if a.baseline:  # the older loader keeps the checkpoint's dtype: compare at bf16
        runs.append(("baseline", "source", a.baseline))
    runs += [("this build", "bfloat16", None), ("this build", "float32", None)]
    rows = []
    for label, dtype, site in runs:
        r = probe(path, dtype, site)
        rows.append({"build": label, "placement": dtype, **r,
                     "meets_goal": r["overhead"] <= budget})
    gib = 1 << 30
    print(f"checkpoint: {len(shards)} shards, largest {max(shards) / gib:.2f} GiB; goal: "
          f"overhead <= {budget / gib:.2f} GiB")
    print(f"{'build':<12}{'weights':>10}{'dtype':>16}{'peak RSS':>10}{'overhead':>10}  goal")
    for r in rows:
        print(f"{r['build']:<12}{r['weight_bytes'] / gib:>9.2f}G{r['dtype']:>16}"
              f"{r['peak_rss'] / gib:>9.2f}G{r['overhead'] / gib:>9.2f}G  "
              f"{'met' if r['meets_goal'] else 'missed'}")
    path_out = write_result("load_memory", {"machine": machine(), "shards": shards,
                                            "budget_bytes": budget, "runs": rows,
                                            "command": " ".join(sys.argv)})
    print(f"wrote {path_out}")


if __name__ == "__main__":
    main()
