"""The router's HTTP front stops as a drain should: the request in flight finishes, and an idle
keep-alive connection over TLS does not hold the stop for the event loop's 30 s SSL shutdown
timeout (every drain of an HTTPS router with an openai client took its whole timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import ssl
import threading

import pytest
from baton.services.router.openai_http import HttpServer
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tests.support.tls import self_signed_cert


class _Front:
    """A stand-in for OpenAIFront: HttpServer only calls ``app()``; this one's /slow request
    waits for the test's word."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def app(self) -> Starlette:
        async def ping(request):
            return PlainTextResponse("pong")

        async def slow(request):
            self.entered.set()
            await asyncio.to_thread(self.release.wait, 60)
            return PlainTextResponse("done")

        return Starlette(routes=[Route("/ping", ping), Route("/slow", slow)])


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return tuple(map(str, self_signed_cert(tmp_path_factory.mktemp("tls"))))


def test_stop_finishes_the_request_in_flight_and_closes_idle_tls_connections(tls):
    front = _Front()
    server = HttpServer(front, "127.0.0.1", 0, tls=tls).start()
    ctx = ssl.create_default_context(cafile=tls[0])

    def connect():
        return http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=60)

    idle = connect()  # one request, then the connection stays open, as a client pool keeps it
    idle.request("GET", "/ping")
    r = idle.getresponse()
    assert (r.status, r.read()) == (200, b"pong")

    slow = connect()
    answer = {}

    def ask_slow():
        slow.request("GET", "/slow")
        r = slow.getresponse()
        answer["got"] = (r.status, r.read())

    asker = threading.Thread(target=ask_slow)
    asker.start()
    assert front.entered.wait(30)
    stopper = threading.Thread(target=server.stop, kwargs={"timeout": 20})
    stopper.start()
    while True:  # the stop has begun once the port refuses new connections
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        except (ConnectionRefusedError, ConnectionResetError):
            break
    front.release.set()
    asker.join(30)
    assert answer["got"] == (200, b"done")  # the request in flight finished
    stopper.join(30)
    # within its 20 s: the idle connection was closed, not waited on for 30 s
    assert not server._thread.is_alive()
    idle.sock.settimeout(10)
    with contextlib.suppress(ConnectionResetError, ssl.SSLError):  # aborted: a reset
        assert idle.sock.recv(1) == b""  # or the end of the stream
