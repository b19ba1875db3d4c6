"""KV hand-off benchmark: NIXL bandwidth against memcpy, and a 2,000-token prompt's hand-off time
against its prefill time. One run, one machine; results in bench/results/transfer-*.json.

    python bench/transfer.py [--sizes-mib 1,16,256] [--repeats 15] [--ucx-tls default,cma,tcp]
        [--baseline DIR]

Part 1 (bandwidth): a holder process registers a KV pool of SmolLM2-shaped blocks (float32, 720
KiB each) and grants leases; this process (the reader, its own registered pool) pulls them with
the production path, ``KVReader.pull`` (NIXL READ + lease release RPC), and times a plain
``memcpy`` of the same number of bytes between two buffers of this process. Block ids are either
consecutive (NIXL merges them into one region) or scattered (one region per block). Each UCX_TLS
setting runs in fresh processes (UCX reads its environment once).

Part 2 (prompt): real prefill and decode worker processes on SmolLM2; a 2,000-token prompt is
prefilled, then handed off; the hand-off time (READ + release, from the decode worker's transfer
stats) is compared with the prefill time the prefill worker reports.

Part 3 (release, with ``--baseline DIR``): the lease release of one-block hand-offs (part 1's
pull, its ``release_s``), with this build and with the build installed in ``DIR``, alternating
round by round, each round in fresh holder and reader processes of that build.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from baton.bench.common import machine, random_word_prompts, write_result

BLOCK_SHAPE = (30, 2, 16, 3, 64)  # SmolLM2, one block: layers, k/v, tokens, kv heads, head dim
MIB = 1 << 20


# ---- part 1: the holder process ----------------------------------------------------------------

def holder_main(pool_blocks: int, leases_json: str) -> None:
    """Register a pool, grant the leases asked for, print the handles, serve until killed."""
    import torch
    try:
        from baton.services.common.process import make_server, new_incarnation
    except ImportError:  # --baseline: a build from before the worker's modules moved
        from baton.services.common.worker import make_server, new_incarnation
    from baton.transfer.agent import KVAgent, configure_ucx
    from baton.transfer.holder import KVHolder
    from baton.transfer.lease import LeaseTable
    from baton.v1 import worker_pb2_grpc

    configure_ucx()
    from baton.engine.runner import alloc_kv_pool

    pool = alloc_kv_pool((pool_blocks, *BLOCK_SHAPE), torch.float32)
    pool.copy_(torch.rand(pool.shape))
    server = make_server()
    port = server.add_insecure_port("127.0.0.1:0")
    incarnation = new_incarnation()
    agent = KVAgent(f"bench-holder/{incarnation}", pool)
    holder = KVHolder(worker_id="bench-holder", incarnation=incarnation,
                      address=f"127.0.0.1:{port}", fingerprint="bench", agent=agent,
                      leases=LeaseTable(ttl_s=600), free=lambda rid: None)
    worker_pb2_grpc.add_KVSourceServicer_to_server(holder, server)
    holder.serve_lease_channel("127.0.0.1")
    server.start()
    for i, blocks in enumerate(json.loads(leases_json)):
        h = holder.grant(f"bench-{i}", tuple(blocks), len(blocks) * BLOCK_SHAPE[2])
        print("HANDLE", h.to_proto().SerializeToString().hex(), flush=True)
    print("HOLDER_READY", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (agent.close(), sys.exit(0)))
    time.sleep(3600)


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.rand(nbytes // 4)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def bandwidth_main(sizes_mib: list[int], repeats: int) -> dict:
    """The reader: one UCX configuration (from this process's environment)."""
    import random

    import torch
    from baton.engine.runner import alloc_kv_pool
    from baton.transfer.agent import KVAgent, configure_ucx
    from baton.transfer.reader import KVReader

    block_nbytes = torch.empty(BLOCK_SHAPE).nbytes
    max_blocks = max(sizes_mib) * MIB // block_nbytes + 1
    pool_blocks = 2 * max_blocks + 8
    rng = random.Random(0)
    plan = []  # (size, layout, blocks) for 1 warm-up + repeats of each
    for size in sizes_mib:
        n = max(1, round(size * MIB / block_nbytes))
        for layout in ("consecutive", "scattered"):
            for _ in range(repeats + 1):
                blocks = (list(range(n)) if layout == "consecutive"
                          else rng.sample(range(pool_blocks), n))
                plan.append((size, layout, blocks))
    configure_ucx()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--_holder", str(pool_blocks),
         json.dumps([b for _, _, b in plan])], stdout=subprocess.PIPE, text=True)
    try:
        handles = _read_handles(proc)
        pool = alloc_kv_pool((pool_blocks, *BLOCK_SHAPE), torch.float32)
        agent = KVAgent("bench-reader", pool)
        reader = KVReader(agent, "bench", "bench-reader")
        rows = {}
        for (size, layout, blocks), handle in zip(plan, handles):
            local = tuple(rng.sample(range(pool_blocks), len(blocks)) if layout == "scattered"
                          else range(pool_blocks - len(blocks), pool_blocks))
            res = reader.pull(handle, local, 0, time.monotonic() + 60)
            rows.setdefault((size, layout), []).append(
                (res.read_s, res.read_s + res.release_s, res.bytes))
        out = {"ucx_tls": os.environ.get("UCX_TLS", "default"), "transports": agent.transports(),
               "block_nbytes": block_nbytes, "sizes": _size_rows(rows, plan, repeats)}
        reader.close()
        agent.close()
        return out
    finally:
        proc.terminate()
        proc.wait()


def _read_handles(proc) -> list:
    """The handles the holder process printed, up to its ready line."""
    from baton.transfer.handle import KVHandle
    from baton.v1 import worker_pb2

    handles = []
    for line in proc.stdout:
        if line.startswith("HANDLE"):
            handles.append(KVHandle.from_proto(
                worker_pb2.KVHandle.FromString(bytes.fromhex(line.split()[1]))))
        elif line.startswith("HOLDER_READY"):
            break
    return handles


def _size_rows(rows: dict, plan: list, repeats: int) -> list[dict]:
    """Per (size, layout): medians of the read and the hand-off against memcpy."""
    out = []
    memcpy = {}  # per size, shared by both layouts: this machine's memcpy is noisy
    for (size, layout), samples in rows.items():
        samples = samples[1:]  # the first one pays the connection set-up
        nbytes = samples[0][2]
        read = statistics.median(s[0] for s in samples)
        handoff = statistics.median(s[1] for s in samples)
        if size not in memcpy:
            memcpy[size] = memcpy_gbps(nbytes, max(15, 2 * repeats))
        mc = memcpy[size]
        out.append({
            "size_mib": size, "layout": layout, "bytes": nbytes, "blocks": len(
                next(b for s, lay, b in plan if s == size and lay == layout)),
            "read_gbps": nbytes / read / 1e9, "handoff_gbps": nbytes / handoff / 1e9,
            "memcpy_gbps": mc, "handoff_vs_memcpy": nbytes / handoff / 1e9 / mc,
            "read_ms": read * 1e3, "handoff_ms": handoff * 1e3,
            "release_samples_ms": [(s[1] - s[0]) * 1e3 for s in samples]})
    return out


# ---- part 2: a 2,000-token prompt between real workers -----------------------------------------

def prompt_main(prompt_tokens: int, repeats: int, dtype: str) -> dict:
    from baton.engine.loader import load_model
    from baton.engine.params import SamplingParams
    from baton.services.common.protocol import params_to_proto
    from baton.services.launch.local import WorkerProcess
    from baton.v1 import worker_pb2, worker_pb2_grpc

    tokenizer = load_model(None).tokenizer
    prompts = random_word_prompts(tokenizer, [prompt_tokens] * (repeats + 1), "transfer-bench")
    common = ["--dtype", dtype, "--num-blocks", str(3 * (prompt_tokens // 16 + 2))]
    prefill = WorkerProcess("prefill", common)
    decode = WorkerProcess("decode", [*common, "--peers", prefill.address])
    try:
        pstub = worker_pb2_grpc.PrefillWorkerStub(prefill.channel)
        dstub = worker_pb2_grpc.DecodeWorkerStub(decode.channel)
        params = params_to_proto(SamplingParams(max_tokens=2, ignore_eos=True))
        rows = []
        for i, ids in enumerate(prompts):
            print(f"  prompt {i + 1}/{len(prompts)}: prefilling {len(ids)} tokens", flush=True)
            pre = pstub.Prefill(worker_pb2.PrefillRequest(
                request_id=f"p{i}", prompt_token_ids=ids, params=params), timeout=600)
            stats = None
            for chunk in dstub.Decode(worker_pb2.DecodeRequest(
                    request_id=f"p{i}", prompt_token_ids=ids, first_token_id=pre.first_token_id,
                    params=params, handle=pre.handle), timeout=120):
                if chunk.HasField("transfer"):
                    stats = chunk.transfer
            rows.append({"prefill_s": pre.prefill_s, "read_s": stats.read_s,
                         "release_s": stats.release_s, "handshake_s": stats.handshake_s,
                         "bytes": stats.bytes, "transports": stats.transports})
        rows = rows[1:]  # the first pays the worker's warm-up
        prefill_s = statistics.median(r["prefill_s"] for r in rows)
        handoff_s = statistics.median(r["read_s"] + r["release_s"] for r in rows)
        return {"prompt_tokens": prompt_tokens, "dtype": dtype, "runs": rows,
                "prefill_s": prefill_s, "handoff_s": handoff_s,
                "handoff_fraction_of_prefill": handoff_s / prefill_s}
    finally:
        decode.stop()
        prefill.stop()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_holder":
        return holder_main(int(sys.argv[2]), sys.argv[3])
    if len(sys.argv) > 1 and sys.argv[1] == "--_bandwidth":
        sizes, repeats = [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
        print("RESULT", json.dumps(bandwidth_main(sizes, repeats)), flush=True)
        return
    args = parse_args()
    result = {"machine": machine(), "bandwidth": [], "prompt": None, "release": None}
    for tls in args.ucx_tls.split(","):
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        if tls != "default":
            env["UCX_TLS"] = tls if tls in ("tcp",) else f"{tls},self,tcp"
        print(f"bandwidth, UCX_TLS={env.get('UCX_TLS', 'default')} ...", flush=True)
        result["bandwidth"].append(run_bandwidth(env, args.sizes_mib, args.repeats))
    if args.baseline:
        result["release"] = release_against(args.baseline, args.release_rounds, args.repeats)
    if not args.skip_prompt:
        print(f"prompt hand-off, {args.prompt_tokens} tokens ...", flush=True)
        result["prompt"] = prompt_main(args.prompt_tokens, args.prompt_repeats, args.dtype)
    print_table(result)
    if not args.no_save:
        print(f"wrote {write_result('transfer', result)}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,16,256")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--ucx-tls", default="default,cma,tcp",
                    help="UCX_TLS settings to compare ('default' leaves UCX_TLS unset)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--prompt-repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-prompt", action="store_true")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also time lease releases of one-block hand-offs with the Baton build "
                         "installed in DIR (pip install --no-deps --target DIR <checkout>) and "
                         "with this one, alternating, in this run")
    ap.add_argument("--release-rounds", type=int, default=6,
                    help="with --baseline: rounds of (this build, baseline), --repeats releases "
                         "per build per round (default 6)")
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args()


def run_bandwidth(env: dict, sizes_mib: str, repeats: int) -> dict:
    """Part 1 in fresh processes under ``env`` (a holder and this script as the reader)."""
    r = subprocess.run([sys.executable, __file__, "--_bandwidth", sizes_mib, str(repeats)],
                       env=env, capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        print(f"  failed:\n{r.stderr[-2000:]}")
        return {"ucx_tls": env.get("UCX_TLS", "default"), "error": r.stderr[-2000:]}
    return json.loads(line.split(" ", 1)[1])


def release_against(baseline: str, rounds: int, repeats: int) -> dict:
    """Lease release time of one-block hand-offs (a 1-block pull's release_s), this build
    against the one in ``baseline``, alternating round by round on the same machine."""
    samples: dict[str, list[float]] = {"current": [], "baseline": []}
    for i in range(rounds):
        for arm in ("current", "baseline"):
            env = dict(os.environ)
            if arm == "baseline":
                env["PYTHONPATH"] = os.pathsep.join(p for p in (baseline, env.get("PYTHONPATH"))
                                                    if p)
            print(f"release, round {i + 1}/{rounds}, {arm} ...", flush=True)
            out = run_bandwidth(env, "0", repeats)
            for row in out.get("sizes", ()):
                if row["layout"] == "consecutive":
                    samples[arm] += row["release_samples_ms"]
    p50 = {arm: statistics.median(v) for arm, v in samples.items() if v}
    return {"baseline_dir": baseline, "samples_ms": samples, "p50_ms": p50,
            "ratio": p50["current"] / p50["baseline"] if len(p50) == 2 else None}


def print_table(result: dict) -> None:
    print(f"\n{'UCX_TLS':<16}{'transports':<14}{'MiB':>5} {'layout':<12}{'read GB/s':>10}"
          f"{'hand-off GB/s':>14}{'memcpy GB/s':>12}{'ratio':>7}")
    for b in result["bandwidth"]:
        for s in b.get("sizes", []):
            print(f"{b['ucx_tls']:<16}{b['transports']:<14}{s['size_mib']:>5} {s['layout']:<12}"
                  f"{s['read_gbps']:>10.2f}{s['handoff_gbps']:>14.2f}{s['memcpy_gbps']:>12.2f}"
                  f"{s['handoff_vs_memcpy']:>7.0%}")
    if result["release"]:
        r = result["release"]
        print(f"\nlease release p50 (one-block hand-offs, {len(r['samples_ms']['current'])} "
              f"each): this build {r['p50_ms'].get('current', float('nan')):.3f} ms, baseline "
              f"{r['p50_ms'].get('baseline', float('nan')):.3f} ms, ratio "
              f"{r['ratio'] or float('nan'):.2f}x")
    if result["prompt"]:
        p = result["prompt"]
        print(f"\n{p['prompt_tokens']}-token prompt ({p['dtype']}): prefill {p['prefill_s']:.3f}s, "
              f"hand-off {p['handoff_s'] * 1e3:.1f} ms = {p['handoff_fraction_of_prefill']:.2%} "
              "of the prefill")


if __name__ == "__main__":
    main()
