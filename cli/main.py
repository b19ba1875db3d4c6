"""The `baton` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _generate(a: argparse.Namespace) -> int:
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.errors import BatonError
    from baton.engine.params import SamplingParams

    try:
        engine = LLMEngine.from_path(a.model, EngineConfig(dtype=a.dtype))
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                top_p=a.top_p, top_k=a.top_k, seed=a.seed)
        if a.chat:
            req = engine.add_request(params=params,
                                     messages=[{"role": "user", "content": a.prompt}])
        else:
            req = engine.add_request(a.prompt, params)
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
    from baton.services.common.worker import params_to_proto
    from baton.v1 import worker_pb2, worker_pb2_grpc

    try:
        tokenizer = load_model(a.model).tokenizer
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = (tokenizer.encode_chat([{"role": "user", "content": a.prompt}]) if a.chat
           else tokenizer.encode(a.prompt))
    p = params_to_proto(params)
    rid = f"cli-{time.time_ns()}"
    try:
        with grpc.insecure_channel(a.prefill) as pch, grpc.insecure_channel(a.decode) as dch:
            pre = worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=ids, params=p), timeout=a.timeout)
            tokens, text, stats, reason = [pre.first_token_id], "", None, pre.finish_reason
            if not reason:
                tokens = []
                for chunk in worker_pb2_grpc.DecodeWorkerStub(dch).Decode(
                        worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids,
                                                 first_token_id=pre.first_token_id, params=p,
                                                 handle=pre.handle,
                                                 sampler_state=pre.sampler_state),
                        timeout=a.timeout):
                    tokens += chunk.token_ids
                    text += chunk.text
                    reason = chunk.finish_reason or reason
                    stats = chunk.transfer if chunk.HasField("transfer") else stats
                    if not a.json:
                        print(chunk.text, end="", flush=True)
            else:
                text = tokenizer.decode([pre.first_token_id])
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    transfer = None
    if stats is not None:
        transfer = {"bytes": stats.bytes, "blocks_read": stats.blocks_read,
                    "blocks_local": stats.blocks_local, "read_ms": stats.read_s * 1e3,
                    "release_ms": stats.release_s * 1e3, "transports": stats.transports}
    if a.json:
        print(json.dumps({"text": text, "token_ids": tokens, "prompt_token_ids": ids,
                          "finish_reason": reason, "prefill_s": pre.prefill_s,
                          "transfer": transfer}))
    else:
        print()
        if transfer:
            print(f"[prefill {pre.prefill_s * 1e3:.0f} ms; KV {transfer['bytes'] / 2**20:.1f} MiB "
                  f"in {transfer['read_ms']:.1f} ms over {transfer['transports'] or '?'}]",
                  file=sys.stderr)
    return 0


def _sampling_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt with the local engine")
    g.add_argument("prompt")
    _sampling_args(g)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--json", action="store_true",
                   help="print one JSON object with text, token_ids, prompt_token_ids")
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
    a = ap.parse_args(argv)
    return _handoff(a) if a.cmd == "handoff" else _generate(a)


if __name__ == "__main__":
    sys.exit(main())
