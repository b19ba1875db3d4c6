"""The decode role on a worker: the ``DecodeWorker`` service. It takes a prefilled request's KV
handle, pulls the blocks over NIXL into its own pool, and streams the rest of the tokens; its
``Generate`` prefills locally too (the local path, colocated workers).

A Decode call, and who frees what on each exit::

    reserve blocks ──► pull (handshake, READ, release lease) ──► commit ──► stream tokens
      │ none free: wait     │ any error: abort (frees the reserved   │ client cancels: abort
      │ until the deadline  │ blocks), typed status; a READ past its │ (frees the blocks)
      │                     │ deadline NIXL cannot cancel: the       │
      │                     │ blocks stay quarantined until it ends  │
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from dataclasses import replace

from baton.engine.engine import LLMEngine
from baton.engine.errors import InvalidRequestError
from baton.services.common import tracing
from baton.services.common.protocol import logprob_to_proto, params_from_proto
from baton.services.worker.engine_loop import EngineLoop
from baton.services.worker.prefill_role import engine_spans, tier_fields
from baton.services.worker.status import (
    NoRoomError,
    abort_with,
    engine_guard,
    tokenizer_info,
    worker_info,
)
from baton.transfer.errors import ReadInFlightError, TransferError
from baton.transfer.handle import KVHandle
from baton.transfer.holder import KVHolder
from baton.transfer.reader import KVReader
from baton.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("baton.services.decode")


class DecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, loop: EngineLoop, reader: KVReader, worker_id: str, incarnation: str,
                 transfer_timeout_s: float, holder: KVHolder | None = None,
                 metrics=None, gate=None) -> None:
        self.holder = holder  # this worker also holds leased blocks (it prefills too)
        self.gate = gate  # services.worker.role.RoleGate: None takes every decode
        self.metrics = metrics
        self.loop, self.reader, self.worker_id = loop, reader, worker_id
        self.incarnation, self.transfer_timeout_s = incarnation, transfer_timeout_s
        self.engine: LLMEngine = loop.engine
        # request id -> a READ that passed its deadline uncancelled (engine thread only)
        self._in_flight: dict[str, object] = {}
        loop.add_tick(self.settle_quarantine)

    def Decode(self, request, context):
        if self.gate is not None:
            self.gate.refuse("decode", context)
        rid = request.request_id or uuid.uuid4().hex
        span = tracing.worker_span(context, "DecodeWorker/Decode", rid, self.worker_id, request)
        yield from tracing.traced_stream(span, context, engine_guard(
            context, self._decode(request, context, rid, span)))

    def _decode(self, request, context, rid: str, span):
        handle = KVHandle.from_proto(request.handle)
        budget = self.transfer_timeout_s
        if context.time_remaining() is not None:
            budget = min(budget, context.time_remaining())
        deadline = time.monotonic() + budget
        try:
            params = params_from_proto(request.params)
            if handle.num_tokens != len(request.prompt_token_ids):
                raise InvalidRequestError("handle.num_tokens", handle.num_tokens,
                               f"the prompt has {len(request.prompt_token_ids)} tokens")
            slots = self._reserve(rid, request, params, deadline, context)
        except Exception as e:
            abort_with(context, e)
        if slots is None:
            return
        if len(handle.block_ids) < len(slots.block_ids):
            self.loop.run(self.engine.abort, rid)
            abort_with(context, InvalidRequestError("handle.block_ids", len(handle.block_ids),
                                         f"{len(slots.block_ids)} blocks are needed"))
        res = self._pull(rid, handle, slots, deadline, context, span)
        # a call that ended during the pull (its blocks were being written: they could not be
        # freed then) ends here, before decoding; one that ends later aborts the request from
        # its callback (add_callback is False once the call has ended)
        if not context.is_active():
            self.loop.run(self.engine.abort, rid)
            return
        stream = self.loop.run(self._commit, rid)
        if not context.add_callback(lambda: self.loop.abort(rid)):
            self.loop.abort(rid)
            return
        stats = worker_pb2.TransferStats(
            bytes=res.bytes, blocks_read=res.blocks_read, blocks_local=res.blocks_local,
            handshake_s=res.handshake_s, read_s=res.read_s, release_s=res.release_s,
            transports=res.transports)
        yield from _relay(stream, context, lambda chunk, out: chunk.transfer.CopyFrom(stats),
                          span)

    def Generate(self, request, context):
        """The local path: prefill here too, then decode (colocated mode, short prompts)."""
        if self.gate is not None:
            self.gate.refuse("decode", context)
        t0 = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        span = tracing.worker_span(context, "DecodeWorker/Generate", rid, self.worker_id,
                                   request, at=t0)
        yield from tracing.traced_stream(span, context, engine_guard(
            context, self._generate(request, context, rid, t0, span)))

    def _generate(self, request, context, rid: str, t0: float, span):
        try:
            params = params_from_proto(request.params)
            stream = self.loop.submit(rid, prompt_token_ids=list(request.prompt_token_ids),
                                      params=params)
        except Exception as e:
            abort_with(context, e)
        if not context.add_callback(lambda: self.loop.abort(rid)):  # the call already ended
            self.loop.abort(rid)
            return

        def first(chunk, out):
            chunk.num_cached_tokens = out.num_cached_tokens
            for name, n in tier_fields(out).items():
                setattr(chunk, name, n)
            chunk.queue_s = out.queue_s or 0.0
            if span.recording:
                engine_spans(span, t0, out)
        yield from _relay(stream, context, first, span)

    def Tokenizer(self, request, context):
        return tokenizer_info(self.engine)

    def _pull(self, rid: str, handle: KVHandle, slots, deadline: float, context, span):
        """READ the holder's blocks into the reserved ones and release the lease. Any failure
        ends the request (its blocks freed, or quarantined while a READ that could not be
        cancelled may still write them) and the call, typed."""
        ts = span.child("baton.kv.transfer", attrs={
            "baton.kv.source_worker": handle.worker_id, "server.address": handle.address,
            "baton.kv.lease_id": handle.lease_id})
        try:
            needed = replace(handle, block_ids=handle.block_ids[:len(slots.block_ids)])
            res = self.reader.pull(needed, slots.block_ids, slots.num_local_blocks, deadline)
        except Exception as e:  # anything between reserve and commit: never a RESERVED orphan
            ts.end(error=e)
            self._end_failed_pull(rid, e)
            log.warning("request %s: hand-off from %s failed: %s", rid, handle.worker_id, e)
            # a TransferError is the holder's (or the path's) failure, not this worker's
            abort_with(context, e, peer=handle.address if isinstance(e, TransferError) else None)
        ts.set({"baton.kv.bytes": res.bytes, "baton.kv.blocks_read": res.blocks_read,
                "baton.kv.blocks_local": res.blocks_local,
                "baton.kv.transport": res.transports or None,
                "baton.kv.handshake_s": res.handshake_s, "baton.kv.read_s": res.read_s,
                "baton.kv.release_s": res.release_s})
        ts.end()
        if self.metrics is not None:
            self.metrics.transfer_bytes.inc(res.bytes)
            self.metrics.transfer_seconds.observe(res.handshake_s + res.read_s + res.release_s)
        return res

    def _end_failed_pull(self, rid: str, e: Exception) -> None:
        if self.metrics is not None:
            self.metrics.transfer_failures.labels(type(e).__name__).inc()
        if isinstance(e, ReadInFlightError):
            self.loop.run(self._quarantine, rid, e.read)
        else:
            self.loop.run(self.engine.abort, rid)

    def _quarantine(self, rid: str, read) -> None:
        """Engine thread: end ``rid`` but hold its blocks until ``read`` settles."""
        n = self.engine.quarantine_handoff(rid)
        self._in_flight[rid] = read
        log.warning("request %s: %d KV blocks quarantined until an uncancellable READ from %s "
                    "ends", rid, n, read.peer)

    def settle_quarantine(self) -> None:
        """Engine thread, every tick: free the blocks of each in-flight READ that settled."""
        for rid, read in list(self._in_flight.items()):
            if read.settled():
                del self._in_flight[rid]
                self.engine.release_quarantine(rid)
                log.info("request %s: the in-flight READ ended; its blocks are free", rid)

    def _reserve(self, rid, request, params, deadline, context):
        """Blocks for the prompt and a slot in the running batch, waiting (until the deadline)
        while the pool or the batch (--max-num-seqs) is full: woken when the engine frees
        blocks (a request ended), or when the call ends."""
        context.add_callback(self.loop.wake)
        while True:
            seen = self.loop.frees
            slots = self.loop.run(self.engine.reserve_handoff, rid,
                                  list(request.prompt_token_ids), request.first_token_id, params)
            if slots is not None:
                return slots
            left = deadline - time.monotonic()
            if left <= 0:  # raised: _decode maps what _reserve raises to a status
                raise NoRoomError("no room for the hand-off before the deadline (free KV "
                                  "blocks and a slot in the running batch, --max-num-seqs)")
            if not context.is_active():
                return None
            self.loop.wait_for_frees(seen, left)

    def _commit(self, rid: str) -> queue.SimpleQueue:
        stream = self.loop.open_stream(rid)
        # the first output may finish the request already (EOS, max_tokens=1): dispatch drops
        # its stream then, as for any finished request
        self.loop.dispatch(self.engine.commit_handoff(rid))
        return stream

    def Info(self, request, context):
        return worker_info(self.loop, "both" if self.holder else "decode", self.worker_id,
                           self.incarnation, self.reader.agent, request.check_integrity,
                           holder=self.holder, num_peers=self.reader.num_peers,
                           pulling=self.reader.pulling)


def _relay(stream, context, on_first, span=tracing.NO_SPAN):
    """Engine outputs -> DecodeChunks until the request finishes; ``on_first(chunk, output)``
    decorates the first chunk; ``span`` gets the first token's time and the usage."""
    first = True
    while True:
        out = stream.get()
        if isinstance(out, BaseException):
            abort_with(context, out)
        chunk = worker_pb2.DecodeChunk(token_ids=out.new_token_ids, text=out.new_text,
                                       finish_reason=out.finish_reason or "",
                                       logprobs=[logprob_to_proto(lp) for lp in out.logprobs or ()
                                                 if lp is not None])
        if first:
            on_first(chunk, out)
            span.event("baton.first_token")
            first = False
        yield chunk
        if out.finished:
            span.set({"gen_ai.usage.output_tokens": out.num_output_tokens,
                      "gen_ai.response.finish_reasons": [out.finish_reason or ""]})
            return
