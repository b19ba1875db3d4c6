"""A prefill and a decode worker process on loopback, and the calls a router would make to
them (the hand-off tests drive workers directly, without a router)."""

from __future__ import annotations

import time

from baton.services.common.protocol import params_to_proto
from baton.services.launch.local import WorkerProcess
from baton.v1 import worker_pb2, worker_pb2_grpc


class Pair:
    """A prefill and a decode worker and the calls a router would make."""

    def __init__(self, prefill: WorkerProcess, decode: WorkerProcess) -> None:
        self.prefill, self.decode = prefill, decode

    def prefill_call(self, ids, params, rid, timeout=120.0):
        stub = worker_pb2_grpc.PrefillWorkerStub(self.prefill.channel)
        return stub.Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, params=params_to_proto(params)),
            timeout=timeout)

    def decode_call(self, ids, params, rid, pre, timeout=120.0):
        stub = worker_pb2_grpc.DecodeWorkerStub(self.decode.channel)
        tokens, stats = [], None
        for chunk in stub.Decode(worker_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=ids, first_token_id=pre.first_token_id,
                params=params_to_proto(params), handle=pre.handle), timeout=timeout):
            tokens += chunk.token_ids
            if chunk.HasField("transfer"):
                stats = chunk.transfer
        return tokens, stats

    def handoff(self, ids, params, rid):
        pre = self.prefill_call(ids, params, rid)
        if pre.finish_reason:
            return [pre.first_token_id], None
        return self.decode_call(ids, params, rid, pre)

    def assert_idle_and_intact(self):
        for w in (self.prefill, self.decode):
            info = eventually(lambda w=w: w.info(check_integrity=True),
                               lambda i: i.num_free_blocks == i.num_blocks)
            assert info.integrity_ok, info.integrity_error
            assert info.num_free_blocks == info.num_blocks, (w.role, info)

    def stop(self):
        for w in (self.decode, self.prefill):
            w.stop()


def eventually(get, ok, timeout: float = 120.0):
    """``get()`` until ``ok(value)``, polled every 50 ms; returns that value. ``timeout`` is a hang
    detector, not a margin: past it the last value fails the test."""
    end = time.monotonic() + timeout
    while True:
        value = get()
        if ok(value):
            return value
        assert time.monotonic() < end, f"still not there after {timeout:.0f}s: {value}"
        time.sleep(0.05)


def start_pair(prefill_args=(), decode_args=(), peers=True) -> Pair:
    prefill = WorkerProcess("prefill", ["--num-blocks", "256", *prefill_args])
    try:
        extra = ["--peers", prefill.address] if peers else []
        decode = WorkerProcess("decode", ["--num-blocks", "256", *extra, *decode_args])
    except BaseException:
        prefill.stop()
        raise
    return Pair(prefill, decode)
