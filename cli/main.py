"""The `baton` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from baton.engine.families import MODEL_HELP


def _generate(a: argparse.Namespace) -> int:
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.errors import BatonError
    from baton.engine.params import SamplingParams

    try:
        # the options first: a bad one is refused before seconds of loading the model
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                top_p=a.top_p, top_k=a.top_k, seed=a.seed)
        engine = LLMEngine.from_path(a.model, EngineConfig(
            dtype=a.dtype, device=a.device, kv_cache_dtype=a.kv_cache_dtype,
            tensor_parallel_size=a.tensor_parallel_size))
        if a.chat:
            req = engine.add_request(params=params,
                                     messages=[{"role": "user", "content": a.prompt}])
        else:
            req = engine.add_request(a.prompt, params)
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _stream(engine, req, a)
    finally:
        engine.close()


def _stream(engine, req, a: argparse.Namespace) -> int:
    prompt_ids = list(req.prompt_token_ids)
    text, ids, reason = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text.append(out.new_text)
            if not a.json:
                print(out.new_text, end="", flush=True)
            if out.finished:
                reason = out.finish_reason
    if a.json:
        print(json.dumps({"text": "".join(text), "token_ids": ids,
                          "prompt_token_ids": prompt_ids, "finish_reason": reason}))
    else:
        print()
    return 0


def _handoff(a: argparse.Namespace) -> int:
    """Prefill on one worker, hand the KV to another over NIXL, stream the decode."""
    import grpc
    from baton.engine.errors import BatonError
    from baton.engine.loader import load_model
    from baton.engine.params import SamplingParams
    from baton.services.common.protocol import params_to_proto

    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                top_p=a.top_p, top_k=a.top_k, seed=a.seed)
        tokenizer = load_model(a.model).tokenizer
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = (tokenizer.encode_chat([{"role": "user", "content": a.prompt}]) if a.chat
           else tokenizer.encode(a.prompt))
    try:
        pre, tokens, text, stats, reason = _prefill_then_decode(a, ids, params_to_proto(params))
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if pre.finish_reason:  # the first token ended it: nothing was handed off
        tokens, text = [pre.first_token_id], tokenizer.decode([pre.first_token_id])
    _report_handoff(a, pre, ids, tokens, text, stats, reason)
    return 0


def _prefill_then_decode(a: argparse.Namespace, ids: list[int], p):
    """The Prefill call, then (unless its first token ended the request) the Decode stream:
    (prefill answer, tokens, text, transfer stats, finish reason)."""
    from baton.v1 import worker_pb2, worker_pb2_grpc

    rid = f"cli-{time.time_ns()}"
    from baton.transfer import cluster_secret

    with cluster_secret.channel(a.prefill) as pch, cluster_secret.channel(a.decode) as dch:
        pre = worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, params=p), timeout=a.timeout)
        tokens, text, stats, reason = [], "", None, pre.finish_reason
        if reason:
            return pre, tokens, text, stats, reason
        for chunk in worker_pb2_grpc.DecodeWorkerStub(dch).Decode(
                worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids,
                                         first_token_id=pre.first_token_id, params=p,
                                         handle=pre.handle),
                timeout=a.timeout):
            tokens += chunk.token_ids
            text += chunk.text
            reason = chunk.finish_reason or reason
            stats = chunk.transfer if chunk.HasField("transfer") else stats
            if not a.json:
                print(chunk.text, end="", flush=True)
    return pre, tokens, text, stats, reason


def _report_handoff(a, pre, ids, tokens, text, stats, reason) -> None:
    transfer = None
    if stats is not None:
        transfer = {"bytes": stats.bytes, "blocks_read": stats.blocks_read,
                    "blocks_local": stats.blocks_local, "read_ms": stats.read_s * 1e3,
                    "release_ms": stats.release_s * 1e3, "transports": stats.transports}
    if a.json:
        print(json.dumps({"text": text, "token_ids": tokens, "prompt_token_ids": ids,
                          "finish_reason": reason, "prefill_s": pre.prefill_s,
                          "transfer": transfer}))
        return
    print()
    if transfer:
        print(f"[prefill {pre.prefill_s * 1e3:.0f} ms; KV {transfer['bytes'] / 2**20:.1f} MiB "
              f"in {transfer['read_ms']:.1f} ms over {transfer['transports'] or '?'}]",
              file=sys.stderr)


def _request(a: argparse.Namespace) -> int:
    """One request to a router's public API, streamed."""
    import grpc
    from baton_client.v1 import api_pb2, api_pb2_grpc

    params = api_pb2.SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                       top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    if a.cache_salt is not None:
        params.cache_salt = a.cache_salt
    req = api_pb2.GenerateRequest(params=params)
    if a.chat:
        req.chat.messages.add(role="user", content=a.prompt)
    else:
        req.text = a.prompt
    text, ids, final = "", [], None
    metadata = (("authorization", f"Bearer {a.token}"),) if a.token else ()
    try:
        if a.tls_ca:
            with open(a.tls_ca, "rb") as f:
                ch = grpc.secure_channel(a.router, grpc.ssl_channel_credentials(f.read()))
        else:
            ch = grpc.insecure_channel(a.router)
        with ch:
            for msg in api_pb2_grpc.BatonStub(ch).Generate(req, timeout=a.timeout,
                                                           metadata=metadata):
                if msg.HasField("delta"):
                    text += msg.delta.text
                    ids += msg.delta.token_ids
                    if not a.json:
                        print(msg.delta.text, end="", flush=True)
                else:
                    final = msg.final
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    _report_request(a, text, ids, final)
    return 0


def _report_request(a: argparse.Namespace, text: str, ids: list[int], final) -> None:
    if a.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({"text": text, "token_ids": ids,
                          "final": MessageToDict(final, preserving_proto_field_name=True)}))
        return
    print()
    t = final.timing
    print(f"[{final.finish_reason}; {final.path} path ({final.route_reason}); "
          f"{final.usage.prompt_tokens} prompt ({final.usage.cached_tokens} cached) + "
          f"{final.usage.completion_tokens} tokens; first token {t.first_token_s * 1e3:.0f}"
          f" ms, total {t.total_s * 1e3:.0f} ms]", file=sys.stderr)


def _sampling_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt with the local engine")
    g.add_argument("prompt")
    _sampling_args(g)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda[:N]: on CUDA the engine runs Triton kernels and "
                        "replays CUDA graphs for decode steps")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache's element type: auto (the --dtype) or fp8 (CUDA only)")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="ranks of the engine's tensor-parallel group, each a process holding "
                        "1/N of the weights (all on --device; default 1)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object with text, token_ids, prompt_token_ids")
    g.set_defaults(func=_generate)


def _add_handoff(sub) -> None:
    h = sub.add_parser(
        "handoff", help="prefill on a prefill worker, decode on a decode worker (KV over NIXL)",
        description="Send PROMPT to a running prefill worker, hand its KV blocks to a running "
                    "decode worker over NIXL, and stream the decoded text. Start the workers "
                    "with `python -m baton.services.prefill` and `python -m "
                    "baton.services.decode --peers PREFILL_ADDRESS`.")
    h.add_argument("prompt")
    h.add_argument("--prefill", required=True, help="prefill worker address, host:port")
    h.add_argument("--decode", required=True, help="decode worker address, host:port")
    _sampling_args(h)
    h.add_argument("--timeout", type=float, default=120.0, help="seconds per call")
    h.add_argument("--json", action="store_true",
                   help="print one JSON object with text, token ids and transfer stats")
    h.set_defaults(func=_handoff)


def _add_up(sub) -> None:
    from baton.cli.up import add_up_args

    u = sub.add_parser("up", help="run the whole cluster on this machine (redis, workers, router)",
                       description="Start an embedded redis-server, prefill and decode workers "
                                   "(or colocated ones) and the router as local processes; "
                                   "Ctrl-C stops them all.")
    add_up_args(u)
    u.set_defaults(func=_up)


def _up(a: argparse.Namespace) -> int:
    from baton.cli.up import up

    return up(a)


def _add_request(sub) -> None:
    r = sub.add_parser("request", help="send one prompt to a running router and stream the answer")
    r.add_argument("prompt")
    r.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address")
    _sampling_args(r)
    r.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    r.add_argument("--cache-salt", default=None,
                   help="isolate this request's prefix cache (e.g. per tenant): prompts under "
                        "different salts never share KV blocks")
    r.add_argument("--token", default=os.environ.get("BATON_AUTH_TOKEN"),
                   help="bearer token for a router started with --auth-token "
                        "(default $BATON_AUTH_TOKEN)")
    r.add_argument("--tls-ca", default=None,
                   help="PEM CA certificate: connect over TLS, trusting it")
    r.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token_ids and the final message")
    r.set_defaults(func=_request)


def _command(sub, name: str, help: str, description: str, add_args, func=None) -> None:
    """A subcommand whose flags ``add_args(parser)`` declares and whose ``func`` runs it."""
    cmd = sub.add_parser(name, help=help, description=description)
    add_args(cmd)
    if func is not None:
        cmd.set_defaults(func=func)


def _add_status(sub) -> None:
    from baton.cli import status

    _command(sub, "status", "the cluster at a glance: routers and workers, load, KV usage, "
             "prefix hits, TTFT/TPOT percentiles",
             "List the routers and workers registered in Redis, with what their /metrics say: "
             "requests, load, KV blocks used, prefix-cache hit rate, TTFT/TPOT percentiles "
             "(since each process started). `baton top` keeps it refreshed.",
             lambda p: status.add_args(p, top=False), status.status)
    _command(sub, "top", "`baton status`, refreshed, over a sliding window",
             "Redraw `baton status` every --interval seconds, with latency percentiles, hit "
             "rates and throughput over the last --window seconds. Ctrl-C quits.",
             lambda p: status.add_args(p, top=True), status.top)


def _add_measuring(sub) -> None:
    """``bench``, ``profile`` and ``tune``."""
    from baton.bench.cli import add_bench_args
    from baton.bench.profile import add_profile_args, cmd_profile
    from baton.control.tune import add_tune_args, cmd_tune

    _command(sub, "bench", "load generator: latency percentiles, throughput, SLO attainment, "
             "goodput; disaggregated vs colocated",
             "Drive Baton (gRPC) or any OpenAI-compatible server with synthetic, shared-prefix "
             "or trace workloads. `baton bench run TARGET`, `baton bench compare`; --help on "
             "each.", add_bench_args)
    _command(sub, "profile", "measure this engine on this machine: prefill, decode step and KV "
             "hand-off times (for `baton tune`)",
             "Time the engine (one core, one torch thread, as workers run under `baton bench "
             "compare`): prefill against batched tokens, decode steps against batch size and "
             "context, and the KV hand-off between real prefill and decode worker processes "
             "against bytes. Writes the profile `baton tune` reads (about 11 minutes for "
             "SmolLM2 on a 2-vCPU VM).", add_profile_args, cmd_profile)
    _command(sub, "tune", "recommend a prefill:decode split (or colocated) for a trace and "
             "SLOs, by simulation",
             "Simulate the trace on every split of --workers workers into prefill and decode "
             "pools and on colocated serving, with `baton profile`'s costs, continuous batching "
             "and queueing; print each configuration's goodput (highest Poisson rate at which "
             "--attainment of requests meet both SLOs) and attainment at the trace's own rate, "
             "recommend one, and plot attainment against rate.", add_tune_args, cmd_tune)


def _add_role(sub) -> None:
    from baton.cli import role

    _command(sub, "role", "switch a worker's role (prefill, decode, both) while it serves",
             "Switch WORKER_ID to ROLE: routers put it in that role's candidate sets and it "
             "takes new work of that role only; its running streams, leases and cached blocks "
             "stay. Returns once the switch took effect (or fails naming why). Needs the "
             "cluster secret when the cluster has one: $BATON_CLUSTER_SECRET, else a local "
             "`baton up`'s on the same Redis (from its state file).",
             role.add_args, role.cmd_role)


def _add_autoscale(sub) -> None:
    from baton.control.autoscale import add_autoscale_args, cmd_autoscale

    _command(sub, "autoscale", "run the SLO autoscaler against Kubernetes Deployments (local "
             "clusters: `baton up --autoscale`)",
             "Every --scale-interval seconds, read the routers' TTFT/TPOT and the decode "
             "workers' KV usage over --scale-window seconds (through the Redis registry and "
             "their /metrics), decide each pool's replicas (grow on pressure > 1, shrink one at "
             "a time after pressure < 0.5 lasted, cooldowns between) and patch the pool "
             "Deployments' scale. Pods drain on SIGTERM, so scale-down fails no request.",
             add_autoscale_args, cmd_autoscale)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (_add_generate, _add_handoff, _add_up, _add_request, _add_status,
                _add_measuring, _add_autoscale, _add_role):
        add(sub)
    for name in ("router", "worker"):  # handed to the process's own parser (see _piece)
        w = sub.add_parser(name, add_help=False,
                           help=f"run one {name} process (see `baton {name} --help`)")
        w.add_argument("args", nargs=argparse.REMAINDER)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["router"], ["worker"]):
        return _piece(argv[0], argv[1:])
    a = parser().parse_args(argv)
    try:
        return a.func(a)
    except BrokenPipeError:  # `baton request ... | head`: the reader left; not an error of ours
        # Python flushes stdout again at exit: point it at /dev/null so that flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # a shell's code for a command ended by SIGPIPE


def _piece(name: str, args: list[str]) -> int:
    """``baton router ARGS`` and ``baton worker --role prefill|decode ARGS``."""
    if name == "router":
        from baton.services.router.server import main as run
    else:
        ap = argparse.ArgumentParser(prog="baton worker", add_help=False)
        ap.add_argument("--role", choices=["prefill", "decode", "both"])
        known, rest = ap.parse_known_args(args)
        if known.role is None:
            print("usage: baton worker --role prefill|decode|both [worker flags; --help lists "
                  "them]",
                  file=sys.stderr)
            return 2
        if known.role == "prefill":
            from baton.services.worker.serve import prefill_main as run
        else:  # decode, or both: the decode server that also serves as a prefill worker
            from baton.services.worker.serve import decode_main as run

            rest = ["--role", known.role, *rest]
        args = rest
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
