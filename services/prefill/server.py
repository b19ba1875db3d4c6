"""The prefill worker: an engine in the prefill role, holding finished prompts' KV under leases.

``python -m baton.services.prefill --help``. Serves ``PrefillWorker`` (Prefill, Info) and
``KVSource`` (Handshake, ReleaseLease) on one gRPC port; decode workers READ the leased blocks
over NIXL. Prints ``BATON_READY <address> <worker id> <incarnation>`` once it serves.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import queue
import time
import uuid

from baton.services.common.engine_loop import EngineLoop
from baton.services.common.worker import (
    abort_with,
    add_engine_args,
    add_server_args,
    add_standard_services,
    announce,
    build_engine,
    logprob_to_proto,
    make_server,
    new_incarnation,
    params_from_proto,
    process_stats,
    register,
    serve_forever,
    setup_logging,
)
from baton.transfer.agent import KVAgent, configure_ucx
from baton.transfer.holder import KVHolder
from baton.transfer.lease import LeaseTable
from baton.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("baton.services.prefill")


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, loop: EngineLoop, holder: KVHolder, worker_id: str) -> None:
        self.loop, self.holder, self.worker_id = loop, holder, worker_id
        self.engine = loop.engine

    def Prefill(self, request, context):
        t0 = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        try:
            params = params_from_proto(request.params)
            stream = self.loop.submit(rid, prompt_token_ids=list(request.prompt_token_ids),
                                      params=params, prefill_only=True)
        except Exception as e:
            abort_with(context, e)
        out = None
        while out is None or not out.finished:
            try:
                out = stream.get(timeout=0.1)
            except queue.Empty:
                if not context.is_active():  # the caller went away: nothing to hand off
                    self.loop.abort(rid)
                    return worker_pb2.PrefillResponse()
                continue
            if isinstance(out, BaseException):
                abort_with(context, out)
        resp = worker_pb2.PrefillResponse(first_token_id=out.new_token_ids[0],
                                          num_cached_tokens=out.num_cached_tokens,
                                          prefill_s=time.monotonic() - t0)
        if out.logprobs:
            resp.first_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
        if out.handoff is None:  # the first token ended it (EOS, stop, max_tokens=1)
            resp.finish_reason = out.finish_reason or ""
            return resp
        h = out.handoff
        resp.sampler_state = h.sampler_state or b""
        blocks = h.block_ids[: math.ceil(h.num_tokens / self.engine.cfg.block_size)]
        handle = self.holder.grant(rid, blocks, h.num_tokens)
        if not context.is_active():  # nobody will read it; do not wait for the expiry
            if self.holder.leases.revoke(handle.lease_id, "the prefill caller went away"):
                self._free(rid)
            return resp
        resp.handle.CopyFrom(handle.to_proto())
        return resp

    def Info(self, request, context):
        return worker_info(self.loop, "prefill", self.worker_id, self.holder.incarnation,
                           self.holder.agent, request.check_integrity, holder=self.holder)

    def Tokenizer(self, request, context):
        return tokenizer_info(self.engine)

    def _free(self, request_id: str) -> None:
        self.loop.call(self.engine.release_handoff, request_id)


def tokenizer_info(engine):
    """What a router needs to tokenize exactly as the workers do."""
    return worker_pb2.TokenizerResponse(model=engine.model_info.name,
                                        tokenizer_json=json.dumps(engine.tokenizer.to_json()),
                                        max_model_len=engine.max_model_len)


def worker_info(loop: EngineLoop, role: str, worker_id: str, incarnation: str, agent: KVAgent,
                check: bool, holder: KVHolder | None = None, num_peers: int = 0):
    engine = loop.engine
    rss, fds = process_stats()

    def snapshot():
        ok, err = True, ""
        if check:
            try:
                engine.check_integrity()
            except AssertionError as e:
                ok, err = False, str(e) or "check_integrity failed"
        return (engine.kv.pool.num_free_blocks, len(engine.scheduler.running), ok, err)

    free, running, ok, err = loop.run(snapshot)
    info = worker_pb2.WorkerInfo(
        worker_id=worker_id, incarnation=incarnation, role=role, fingerprint=engine.fingerprint,
        transports=agent.transports(), ucx_tls=agent.ucx_tls, rss_bytes=rss, open_fds=fds,
        num_blocks=engine.num_blocks, num_free_blocks=free, running_requests=running,
        integrity_ok=ok, integrity_error=err, known_peers=num_peers)
    if holder is not None:
        info.active_leases = len(holder.leases)
        info.leases_granted = holder.leases.num_granted
        info.leases_expired = holder.leases.num_expired
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m baton.services.prefill",
        description="Baton prefill worker: computes prompts' KV and first token, and holds the "
                    "KV blocks under a lease until a decode worker has read them over NIXL.")
    add_engine_args(ap)
    add_server_args(ap)
    g = ap.add_argument_group("KV hand-off")
    g.add_argument("--lease-ttl", type=float, default=30.0,
                   help="seconds a prefilled request's blocks stay pinned for a reader "
                        "(default 30); an expired lease frees them and its reader is refused")
    g.add_argument("--kv-checksums", action="store_true",
                   help="send per-block CRC32s in each handle for readers to verify (debugging)")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    configure_ucx()
    engine = build_engine(args)
    incarnation = new_incarnation()
    server = make_server()
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    address = f"{args.host}:{port}"
    worker_id = args.worker_id or f"prefill-{args.host}-{port}"
    agent = KVAgent(f"{worker_id}/{incarnation}", engine.kv_cache)
    holder: KVHolder
    loop = EngineLoop(engine, on_tick=lambda: holder.sweep())
    holder = KVHolder(worker_id=worker_id, incarnation=incarnation, address=address,
                      fingerprint=engine.fingerprint, agent=agent,
                      leases=LeaseTable(args.lease_ttl),
                      free=lambda rid: loop.call(engine.release_handoff, rid),
                      checksums=args.kv_checksums)
    holder.serve_lease_channel(args.host)
    loop.start()
    service = PrefillService(loop, holder, worker_id)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(service, server)
    worker_pb2_grpc.add_KVSourceServicer_to_server(holder, server)
    health = add_standard_services(server, ["baton.v1.PrefillWorker", "baton.v1.KVSource"])
    server.start()
    log.info("prefill worker %s (incarnation %s) serving on %s, model fingerprint %s",
             worker_id, incarnation, address, engine.fingerprint[:16])
    registration = register(args, "prefill", worker_id, address, engine.fingerprint, incarnation,
                            engine.model_info.name)
    announce(address, worker_id, incarnation)

    def stop() -> None:
        holder.shutdown()
        loop.stop()
        agent.close()

    serve_forever(server, stop, registration, args.drain_timeout, health=health)


if __name__ == "__main__":
    main()
