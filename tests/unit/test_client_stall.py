"""A gRPC client that stops reading (its process paused, or its machine stopped) keeps its
streams for the server's ``stall_timeout_s`` and loses them past it. Real gRPC server and client
on loopback; the client runs in a child process that the test SIGSTOPs while the server fills
its receive window, then SIGCONTs. gRPC's own default (20 s) cut the load generator's
connection, with every stream on it, after the machine paused for over 20 s (docs/routing.md,
runs 34 and 36); the router's gRPC front now waits ``--client-stall-timeout`` (60 s)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import grpc
import pytest
from baton.services.common.process import make_server
from baton.services.router import server as router_server

CHUNK = b"x" * 65536
CHUNKS = 2000  # 128 MiB: far past what loopback's buffers and the HTTP/2 windows hold
# set once the client is stopped: the server sends the first chunk, then the rest only after
# it. Without it a client that read fast could take all 128 MiB before the test stopped it (on
# a loaded 2-core CI machine the test process was descheduled that long once, and the cut
# test saw the whole stream arrive)
_PAUSED = threading.Event()


def _bulk(request: bytes, context):
    yield CHUNK
    if not _PAUSED.wait(60):
        raise RuntimeError("the test never stopped the client")
    for _ in range(CHUNKS - 1):
        yield CHUNK


def _client(port: int, got_first, out) -> None:
    """Read one stream to its end; put ("ok", chunks) or (code, details)."""
    n = 0
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for _ in ch.unary_stream("/test.Bulk/Stream")(b"", timeout=120):
                n += 1
                got_first.set()
        out.put(("ok", n))
    except grpc.RpcError as e:
        out.put((e.code().name, e.details()))


def _stream_through_a_pause(stall_timeout_s: float, pause_s: float):
    _PAUSED.clear()
    server = make_server(max_workers=4, stall_timeout_s=stall_timeout_s)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Bulk", {"Stream": grpc.unary_stream_rpc_method_handler(_bulk)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ctx = mp.get_context("spawn")
    got_first, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_client, args=(port, got_first, out), daemon=True)
    child.start()
    try:
        assert got_first.wait(60), "the client never got a first chunk"
        os.kill(child.pid, signal.SIGSTOP)
        _PAUSED.set()
        # the server writes on meanwhile: the client's receive window fills and stays full.
        # The pause is what the test applies, not a margin it waits out
        time.sleep(pause_s)
        os.kill(child.pid, signal.SIGCONT)
        result = out.get(timeout=120)
        child.join(30)
        return result
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        server.stop(None)


@pytest.mark.slow
def test_a_pause_past_grpcs_default_keeps_the_stream_at_the_routers_stall_timeout():
    # 25 s: past gRPC's 20 s (this test fails without the option), within the router's 60 s
    assert _stream_through_a_pause(router_server.CLIENT_STALL_TIMEOUT_S, pause_s=25) == \
        ("ok", CHUNKS)


@pytest.mark.slow
def test_a_pause_past_the_stall_timeout_cuts_the_connection():
    # the same pause against a short stall timeout: what the router's clients met at gRPC's
    # 20 s default when the machine stopped for longer
    code, details = _stream_through_a_pause(stall_timeout_s=1.5, pause_s=6)
    assert code == "UNAVAILABLE", details


def test_the_routers_grpc_front_takes_its_stall_timeout_from_the_flag(monkeypatch):
    made = []
    monkeypatch.setattr(router_server, "make_server",
                        lambda **kw: made.append(kw) or make_server(**kw))
    base = ["--redis-url", "redis://127.0.0.1:1/0", "--port", "0"]
    for argv, want in ((base, router_server.CLIENT_STALL_TIMEOUT_S),
                       (base + ["--client-stall-timeout", "90"], 90.0)):
        cfg = router_server.RouterConfig.from_args(router_server.parser().parse_args(argv))
        server, _ = router_server.grpc_server(cfg)
        server.stop(None)
        assert made.pop()["stall_timeout_s"] == want
    with pytest.raises(ValueError, match="--client-stall-timeout 0"):
        router_server.RouterConfig.from_args(
            router_server.parser().parse_args(base + ["--client-stall-timeout", "0"]))
