"""The prefill role on a worker: the ``PrefillWorker`` service and the KV holder behind it (leases
over the blocks decode workers READ). A prefill worker serves only this role; a colocated worker
(``--role both``, the decode worker's process) serves it beside the decode role, so the role lives
here, below both worker packages.
"""

from __future__ import annotations

import logging
import math
import time
import uuid

import grpc
from baton.services.common import tracing
from baton.services.common.config import HolderSettings
from baton.services.common.protocol import logprob_to_proto, params_from_proto
from baton.services.worker.boot import WorkerBoot
from baton.services.worker.engine_loop import EngineLoop
from baton.services.worker.status import abort_with, tokenizer_info, worker_info
from baton.transfer.holder import KVHolder
from baton.transfer.lease import LeaseTable
from baton.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("baton.services.prefill")


_CALL_ENDED = object()  # put in a request's output queue when its Prefill call ends


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    """``max_leased_blocks``: backpressure. While that many blocks wait under leases for decode
    workers to read them, new prompts are refused (RESOURCE_EXHAUSTED, which the router takes
    as "try another worker or prefill locally") instead of piling up more leased blocks."""

    def __init__(self, loop: EngineLoop, holder: KVHolder, worker_id: str,
                 max_leased_blocks: int = 0, gate=None) -> None:
        self.loop, self.holder, self.worker_id = loop, holder, worker_id
        self.gate = gate  # services.worker.role.RoleGate: None takes every prefill
        self.engine = loop.engine
        self.max_leased_blocks = max_leased_blocks
        self.refused = 0

    def Prefill(self, request, context):
        if self.gate is not None:
            self.gate.refuse("prefill", context)
        t0 = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        span = tracing.worker_span(context, "PrefillWorker/Prefill", rid, self.worker_id,
                                   request, at=t0)
        return tracing.traced_call(span, context, self._prefill, request, context, rid, t0,
                                   span)

    def _admit(self, context) -> None:
        """Backpressure: refuse (RESOURCE_EXHAUSTED, raises) while too many blocks wait under
        leases for decode workers to read them."""
        if not self.max_leased_blocks:
            return
        leased = self.holder.leases.num_blocks()
        if leased >= self.max_leased_blocks:
            self.refused += 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{leased} KV blocks wait for decode workers to read them "
                          f"(max_leased_blocks={self.max_leased_blocks}, "
                          "--max-leased-share): the decode pool is not keeping up")

    def _prefill(self, request, context, rid: str, t0: float, span):
        self._admit(context)
        try:
            params = params_from_proto(request.params)
            stream = self.loop.submit(rid, prompt_token_ids=list(request.prompt_token_ids),
                                      params=params, prefill_only=True)
        except Exception as e:
            abort_with(context, e)
        # the call's end (the caller went away, its deadline) wakes the wait below at once
        if not context.add_callback(lambda: stream.put(_CALL_ENDED)):
            stream.put(_CALL_ENDED)
        out = None
        while out is None or not out.finished:
            out = stream.get()
            if out is _CALL_ENDED:  # nothing to hand off to
                self.loop.abort(rid)
                return worker_pb2.PrefillResponse()
            if isinstance(out, BaseException):
                abort_with(context, out)
        resp = worker_pb2.PrefillResponse(first_token_id=out.new_token_ids[0],
                                          num_cached_tokens=out.num_cached_tokens,
                                          prefill_s=time.monotonic() - t0,
                                          queue_s=out.queue_s or 0.0,
                                          **tier_fields(out))
        if out.logprobs:
            resp.first_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
        if span.recording:
            engine_spans(span, t0, out)
        if out.handoff is None:  # the first token ended it (EOS, stop, max_tokens=1)
            resp.finish_reason = out.finish_reason or ""
            resp.first_text = out.new_text or ""
            return resp
        h = out.handoff
        blocks = h.block_ids[: math.ceil(h.num_tokens / self.engine.cfg.block_size)]
        handle = self.holder.grant(rid, blocks, h.num_tokens)
        if not context.is_active():  # nobody will read it; do not wait for the expiry
            if self.holder.leases.revoke(handle.lease_id, "the prefill caller went away"):
                self._free(rid)
            return resp
        resp.handle.CopyFrom(handle.to_proto())
        span.set({"baton.kv.lease_id": handle.lease_id, "baton.kv.blocks_leased": len(blocks)})
        return resp

    def Info(self, request, context):
        return worker_info(self.loop, "prefill", self.worker_id, self.holder.incarnation,
                           self.holder.agent, request.check_integrity, holder=self.holder)

    def Tokenizer(self, request, context):
        return tokenizer_info(self.engine)

    def _free(self, request_id: str) -> None:
        self.loop.call(self.engine.release_handoff, request_id)


def tier_fields(out) -> dict[str, int]:
    """An output's cached tokens loaded back from the KV tiers, as the protos' fields."""
    by = out.cached_tokens_by_tier or {}
    return {"cached_tokens_host": by.get("host", 0), "cached_tokens_disk": by.get("disk", 0)}


def engine_spans(span, t0: float, out) -> None:
    """Queue and prefill spans under ``span`` for a request that arrived at ``t0`` and whose
    first output is ``out``."""
    start = t0 + (out.queue_s or 0.0)
    first = t0 + out.first_token_s if out.first_token_s is not None else time.monotonic()
    span.child("baton.engine.queue", at=t0).end(at=start)
    span.child("baton.engine.prefill", attrs={
        "baton.usage.cached_tokens": out.num_cached_tokens,
        "gen_ai.usage.input_tokens": out.num_prompt_tokens}, at=start).end(at=max(first, start))
    span.set({"baton.usage.cached_tokens": out.num_cached_tokens,
              "baton.timing.queue_s": out.queue_s or 0.0})


def add_prefill_role(server, loop: EngineLoop, boot: WorkerBoot,
                     settings: HolderSettings, gate=None) -> KVHolder:
    """Serve PrefillWorker and KVSource for ``loop``'s engine on ``server``: leases on its pool,
    the lease channel, and the expired-lease sweep on the engine thread. Used by prefill workers
    and by decode workers started with ``--role both``."""
    engine = loop.engine
    holder = KVHolder(worker_id=boot.worker_id, incarnation=boot.incarnation,
                      address=boot.address, fingerprint=engine.fingerprint, agent=boot.agent,
                      leases=LeaseTable(settings.lease_ttl),
                      free=lambda rid: loop.call(engine.release_handoff, rid),
                      checksums=settings.kv_checksums)
    holder.serve_lease_channel(boot.host)
    loop.add_tick(holder.sweep)
    share = settings.max_leased_share
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(
        PrefillService(loop, holder, boot.worker_id,
                       max(1, int(share * engine.num_blocks)) if share else 0, gate), server)
    worker_pb2_grpc.add_KVSourceServicer_to_server(holder, server)
    return holder
