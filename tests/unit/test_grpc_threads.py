"""A worker's short calls run on threads of their own: with every thread of its gRPC server held
by long calls (decode streams, queued prefill calls), a health check and a role switch still
answer at once instead of waiting for one of those calls to end. Real gRPC server and client on
loopback; the long call is a test method that holds its thread until the test lets it go."""

from __future__ import annotations

import threading

import grpc
from baton.services.common.process import add_standard_services, make_server
from baton.services.worker.boot import CONTROL_METHODS, data_threads
from baton.services.worker.role import AdminService, RoleGate
from baton.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HOLD = "/test.Hold/Wait"


def _hold_service(entered: list[threading.Event], release: threading.Event):
    """``/test.Hold/Wait``: the n-th call sets ``entered[n]`` once it has a thread, then holds
    it until ``release``."""
    calls = iter(entered)

    def wait(request: bytes, context) -> bytes:
        next(calls).set()
        release.wait()
        return b""

    handler = grpc.unary_unary_rpc_method_handler(wait)
    return grpc.method_handlers_generic_handler("test.Hold", {"Wait": handler})


def test_control_calls_answer_while_every_thread_is_held():
    entered = [threading.Event(), threading.Event()]
    release = threading.Event()
    server = make_server(max_workers=1, control=CONTROL_METHODS)
    server.add_generic_rpc_handlers((_hold_service(entered, release),))
    gate = RoleGate("decode")
    worker_pb2_grpc.add_WorkerAdminServicer_to_server(AdminService(gate, "w", lambda: None),
                                                      server)
    add_standard_services(server, ["baton.v1.WorkerAdmin"])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            hold = ch.unary_unary(HOLD)
            first = hold.future(b"", timeout=120)
            assert entered[0].wait(60), "the first long call never got a thread"
            second = hold.future(b"", timeout=120)  # waits: the one data thread is held
            # a full server, as a decode worker with every stream running: these would wait
            # for the long call to end (the 30 s role-switch deadline expired this way)
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            answer = worker_pb2_grpc.WorkerAdminStub(ch).SetRole(
                worker_pb2.SetRoleRequest(role="prefill"), timeout=30)
            assert (answer.previous, answer.role, gate.role) == ("decode", "prefill", "prefill")
            assert not entered[1].is_set(), "the second long call had a thread of its own"
            release.set()
            first.result()
            second.result()
            assert entered[1].is_set()
    finally:
        release.set()
        server.stop(None)


def test_a_worker_has_a_thread_for_every_stream_its_batch_admits():
    # a Decode or Generate stream holds its thread for its whole output: fewer threads than
    # --max-num-seqs capped the batch at the thread count (32) whatever the flag said
    for seqs in (1, 64, 256):
        assert data_threads(seqs) > seqs
