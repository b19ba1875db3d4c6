"""How a worker reports: its errors as typed gRPC statuses (with the rejected field or the
failed peer in trailing metadata), its tokenizer for routers, and its state for Info calls
(pool counts, integrity, leases, /proc statistics)."""

from __future__ import annotations

import json
import os

import grpc
from baton.engine.errors import InvalidRequestError
from baton.services.common.protocol import FIELD_METADATA, PEER_METADATA
from baton.transfer.errors import (
    ChecksumMismatchError,
    FingerprintMismatchError,
    LeaseLostError,
    PeerUnavailableError,
    TransferDeadlineError,
)
from baton.v1 import worker_pb2


class EngineDied(RuntimeError):
    """The engine thread stopped on an unexpected error; every open stream gets this (the
    engine loop raises it; defined here, torch-free, for the status it maps to)."""


class NoRoomError(Exception):
    """This worker cannot take the request now (KV blocks, a slot in its running batch) within
    the call's time: RESOURCE_EXHAUSTED. Raised, not ``context.abort``-ed, by code inside a
    ``try`` that maps exceptions to statuses: an abort there raises a bare ``Exception`` that
    such a handler would turn into INTERNAL."""


_STATUS = [  # most specific first
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (FingerprintMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseLostError, grpc.StatusCode.ABORTED),
    (ChecksumMismatchError, grpc.StatusCode.DATA_LOSS),
    (TransferDeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PeerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (EngineDied, grpc.StatusCode.UNAVAILABLE),  # this worker is going away: try another
    (NoRoomError, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def status_for(e: BaseException) -> grpc.StatusCode:
    for cls, code in _STATUS:
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INTERNAL


def engine_guard(context: grpc.ServicerContext, stream):
    """Relay a server stream; an :class:`EngineDied` raised anywhere in it (a call to the dead
    engine) ends the call UNAVAILABLE, which the router retries, instead of escaping as
    UNKNOWN."""
    try:
        yield from stream
    except EngineDied as e:
        abort_with(context, e)


def abort_with(context: grpc.ServicerContext, e: BaseException, peer: str | None = None):
    """End the RPC with the typed status for ``e`` and its message (raises). An invalid field is
    named in the ``baton-field`` trailing metadata too, so the router reports it as it is;
    ``peer``: the worker the failure came from (``baton-failed-peer``), when not this one."""
    field = getattr(e, "field", None)
    meta = [(FIELD_METADATA, field)] if isinstance(field, str) else []
    if peer:
        meta.append((PEER_METADATA, peer))
    if meta:
        context.set_trailing_metadata(tuple(meta))
    context.abort(status_for(e), f"{type(e).__name__}: {e}")


def tokenizer_info(engine):
    """What a router needs to tokenize exactly as the workers do."""
    return worker_pb2.TokenizerResponse(model=engine.model_info.name,
                                        tokenizer_json=json.dumps(engine.tokenizer.to_json()),
                                        max_model_len=engine.max_model_len)


def worker_info(loop, role: str, worker_id: str, incarnation: str, agent, check: bool,
                holder=None, num_peers: int = 0, pulling: int = 0):
    """WorkerInfo for Info RPCs; pool counts and the integrity check run on the engine thread."""
    engine = loop.engine
    rss, fds = process_stats()

    def snapshot():
        ok, err = True, ""
        if check:
            try:
                engine.check_integrity()
            except AssertionError as e:
                ok, err = False, str(e) or "check_integrity failed"
        stats = engine.stats()
        return (stats.free_blocks, stats.running, ok, err)

    free, running, ok, err = loop.run(snapshot)
    info = worker_pb2.WorkerInfo(
        worker_id=worker_id, incarnation=incarnation, role=role, fingerprint=engine.fingerprint,
        transports=agent.transports(), ucx_tls=agent.ucx_tls, rss_bytes=rss, open_fds=fds,
        num_blocks=engine.num_blocks, num_free_blocks=free, running_requests=running,
        integrity_ok=ok, integrity_error=err, known_peers=num_peers,
        handoffs_in_flight=pulling, device=engine.cfg.device, kv_memory=agent.memory,
        kv_staged_bytes=agent.staged_bytes)
    if holder is not None:
        info.active_leases = len(holder.leases)
        info.leases_granted = holder.leases.num_granted
        info.leases_expired = holder.leases.num_expired
    return info


def process_stats() -> tuple[int, int]:
    """(resident bytes, open file descriptors) of this process."""
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir("/proc/self/fd"))
