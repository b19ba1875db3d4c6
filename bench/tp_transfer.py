"""KV hand-off between pools of different layouts and tensor-parallel sizes: an 8B-shaped
2,000-token prompt (Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, 16-token blocks: 125 blocks,
250 MiB) read by one NIXL agent from another process's pool, for each (holder, reader) layout
pair, against today's block-major pair in the same run and against a memcpy of the same bytes.

    python bench/tp_transfer.py [--repeats 5] [--device cpu|cuda] [--smoke]

Per pair it reports: the descriptors and bytes per (holder rank, reader rank) pair (what the
plan asks NIXL for: KV heads in the pair's slice x runs of consecutive blocks), the median READ
time of the whole hand-off and its bandwidth, for the blocks in one run (consecutive on both
sides) and scattered (every block its own run). Both pools are whole-group pools
(``engine/kv_layout.py``): the ranks of a group share one registered region, so one agent per
side moves every rank pair's descriptors in one READ. ``--device cuda`` puts both pools in VRAM
(UCX's cuda_ipc between the two processes) and compares with a device-to-device copy.

And what each layout costs the per-block copies around a hand-off (16 blocks): a KV tier's
offload and load, the staged mirror's copy of a run, the checksums.

Results: bench/results/tp-transfer-*.json with the machine's description, and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from baton.bench.common import machine, write_result

LAYERS, HEADS, DIM, BLOCK, TOKENS = 32, 8, 128, 16, 2000
# (holder kind, holder TP, reader kind, reader TP); the first is today's layout
PAIRS = [("block", 1, "block", 1), ("head", 1, "head", 1), ("head", 1, "head", 2),
         ("head", 2, "head", 1), ("head", 2, "head", 2), ("head", 2, "head", 4),
         ("head", 4, "head", 2), ("head", 8, "head", 1), ("head", 1, "head", 8)]


def _layout(kind: str, tp: int, smoke: bool):
    from baton.engine.kv_layout import KVLayout

    if smoke:
        return KVLayout(kind, 2, 4, HEADS, 16, "bfloat16", tp)
    return KVLayout(kind, LAYERS, BLOCK, HEADS, DIM, "bfloat16", tp)


def _marks(lay, blocks: int, device: str):
    """[blocks, H] value of each (block, head): head + 8 * (block % 16), exact in bf16."""
    import torch

    heads = torch.tensor(range(HEADS) if lay.kind == "block" else lay.slots)
    vals = heads[None, :] + 8 * (torch.arange(blocks) % 16)[:, None]
    return vals.to(torch.bfloat16).to(device)


def holder_main(kind: str, tp: int, blocks: int, device: str, smoke: bool) -> None:
    """Register a pool of that layout, print how to reach it, serve until stdin closes."""
    import torch
    from baton.transfer.agent import KVAgent, configure_ucx

    configure_ucx()
    lay = _layout(kind, tp, smoke)
    pool = torch.empty(lay.storage_shape(blocks), dtype=torch.bfloat16, device=device)
    view = lay.view(pool)
    view.copy_(_marks(lay, blocks, device)[:, None, None, None, :, None].expand(view.shape))
    agent = KVAgent(f"tp-holder-{kind}{tp}", pool, layout=lay)
    print(json.dumps({"meta": agent.metadata().hex(), "base": agent.base,
                      "block_nbytes": agent.block_nbytes, "num_blocks": agent.num_blocks,
                      "mem": agent.mem_type, "dev": agent.device_id,
                      "layout": lay.to_wire()}), flush=True)
    while sys.stdin.readline():
        agent.wake()
    agent.close()


def _pair(h: tuple, r: tuple, blocks: int, need: int, args) -> dict:
    import torch
    from baton.transfer.agent import KVAgent

    hold = subprocess.Popen([sys.executable, __file__, "--holder", f"{h[0]}:{h[1]}",
                             "--blocks", str(blocks), "--device", args.device,
                             *(["--smoke"] if args.smoke else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = hold.stdout.readline()
        while line and not line.startswith("{"):  # NIXL logs to stdout first
            line = hold.stdout.readline()
        info = json.loads(line)
        lay = _layout(r[0], r[1], args.smoke)
        pool = torch.zeros(lay.storage_shape(blocks), dtype=torch.bfloat16, device=args.device)
        agent = KVAgent(f"tp-reader-{r[0]}{r[1]}-{time.monotonic_ns()}", pool, layout=lay)
        peer = agent.add_peer(bytes.fromhex(info["meta"]), info["base"], info["block_nbytes"],
                              info["num_blocks"], info["mem"], info["dev"], info["layout"])
        holder = _layout(h[0], h[1], args.smoke)
        out = {"pair": f"{h[0]} x{h[1]} -> {r[0]} x{r[1]}",
               "holder": holder.describe(), "reader": lay.describe(),
               "bytes": need * lay.block_nbytes // len(lay.slots) * len(set(lay.slots))}
        for name, ids in (("one_run", list(range(need))),
                          ("scattered", list(range(0, 2 * need, 2)))):
            times = []
            for i in range(args.repeats + 1):
                hold.stdin.write("\n")
                hold.stdin.flush()
                t0 = time.perf_counter()
                agent.read(peer, ids, ids, time.monotonic() + 120)
                if i:  # the first read sets up the connection
                    times.append(time.perf_counter() - t0)
            want = _marks(lay, blocks, args.device)[ids]
            got = lay.view(pool)[ids]
            if not torch.equal(got, want[:, None, None, None, :, None].expand(got.shape)):
                raise SystemExit(f"{holder.describe()} -> {lay.describe()}: wrong KV read")
            runs = 1 if name == "one_run" else need
            per = lay.descriptors(holder, runs)
            chunk = lay.chunk_nbytes
            out[name] = {
                "runs": runs, "read_s": statistics.median(times), "reads_s": times,
                "descriptors": sum(per.values()),
                "per_rank_pair": {f"{a}->{b}": {"descriptors": n,
                                                "bytes": n // runs * len(ids) * chunk}
                                  for (a, b), n in sorted(per.items())}}
        out["checked"] = True  # every head of every block read holds the holder's values
        out["transports"] = agent.transports()
        agent.close()
        return out
    finally:
        hold.stdin.close()
        hold.wait(timeout=30)


def copies_part(device: str, smoke: bool) -> dict:
    """What each layout costs the per-block copies around a hand-off, 16 blocks of the 8B
    shape: a KV tier's offload (index_select) and load (index_copy_), the staged mirror's copy
    of a run of blocks, and the checksums (one replica of each head, contiguous, per block)."""
    import zlib

    import torch

    def med(fn) -> float:
        fn()
        xs = []
        for _ in range(3 if smoke else 15):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device != "cpu":
                torch.cuda.synchronize()
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs)

    out = {}
    for kind in ("block", "head"):
        lay = _layout(kind, 1, smoke)
        pool = torch.zeros(lay.storage_shape(160), dtype=torch.bfloat16, device=device)
        mirror = torch.zeros_like(pool)
        v, m = lay.view(pool), lay.view(mirror)
        ids = torch.arange(8, 24, device=device)
        host = torch.empty((16, *v.shape[1:]), dtype=v.dtype, device=device)
        out[kind] = {
            "tier_offload_s": med(lambda v=v, ids=ids: v.index_select(0, ids)),
            "tier_load_s": med(lambda v=v, ids=ids, host=host: v.index_copy_(0, ids, host)),
            "mirror_run_s": med(lambda v=v, m=m: m[8:24].copy_(v[8:24])),
            "crc32_s": med(lambda v=v: [zlib.crc32(v[b].contiguous().view(torch.uint8)
                                                   .cpu().numpy()) for b in range(8, 24)])}
    out["head_vs_block"] = {k: out["head"][k] / out["block"][k] for k in out["block"]}
    return out


def _copy_s(nbytes: int, device: str, repeats: int) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape and one repeat: checks the script runs (tests)")
    ap.add_argument("--holder", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.holder:
        kind, tp = args.holder.split(":")
        holder_main(kind, int(tp), args.blocks, args.device, args.smoke)
        return 0
    if args.smoke:
        args.repeats = 1
    from baton.transfer.agent import configure_ucx

    configure_ucx()  # the reader's UCX too: VRAM GETs over cuda_ipc, its transports logged
    need = -(-TOKENS // BLOCK)
    blocks = 2 * need + 1  # room for the scattered ids
    rows = []
    for h0, h1, r0, r1 in PAIRS:
        rows.append(_pair((h0, h1), (r0, r1), blocks, need, args))
        print(f"  {rows[-1]['pair']}: "
              f"{rows[-1]['one_run']['read_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    copy_s = _copy_s(rows[0]["bytes"], args.device, args.repeats)
    base = rows[0]
    for r in rows:
        for k in ("one_run", "scattered"):
            r[k]["gb_s"] = r["bytes"] / r[k]["read_s"] / 1e9
            r[k]["vs_today"] = base[k]["read_s"] / r[k]["read_s"]
            r[k]["of_copy"] = copy_s / r[k]["read_s"]
    result = {"bench": "tp-transfer", "machine": machine(), "device": args.device,
              "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM,
                        "block_size": BLOCK, "tokens": TOKENS, "dtype": "bfloat16",
                        "smoke": args.smoke},
              "repeats": args.repeats, "copy_s": copy_s, "pairs": rows,
              "copies": copies_part(args.device, args.smoke),
              "ucx_tls": os.environ.get("UCX_TLS", "default")}
    path = write_result("tp-transfer" + ("-smoke" if args.smoke else ""), result)
    print(f"{'holder -> reader (kind x TP)':<28} {'desc':>5} {'ms':>7} {'GB/s':>6} {'x today':>7} "
          f"{'of copy':>7} | scattered: {'desc':>5} {'ms':>7} {'x today':>7}")
    for r in rows:
        a, s = r["one_run"], r["scattered"]
        print(f"{r['pair']:<28} {a['descriptors']:>5} "
              f"{a['read_s'] * 1e3:>7.1f} {a['gb_s']:>6.2f} {a['vs_today']:>7.2f} "
              f"{a['of_copy']:>7.2f} | {s['descriptors']:>16} {s['read_s'] * 1e3:>7.1f} "
              f"{s['vs_today']:>7.2f}")
    c = result["copies"]
    print("16 blocks, head-major / block-major time: " + ", ".join(
        f"{k.removesuffix('_s')} {c['block'][k] * 1e3:.2f} -> {c['head'][k] * 1e3:.2f} ms "
        f"({v:.2f}x)" for k, v in c["head_vs_block"].items()))
    print(f"memcpy of {base['bytes'] / 2**20:.0f} MiB: {copy_s * 1e3:.1f} ms; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
