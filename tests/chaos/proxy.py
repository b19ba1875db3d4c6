"""A TCP proxy on loopback that can delay, black-hole or cut the traffic it carries: the network
faults the chaos suite injects between two processes (a worker registers the proxy's port with
``--advertise-port``, so routers and peers reach it through the proxy).

    healthy ──► delay(s): every chunk waits s seconds, both ways
            ──► stall(): nothing moves; connections stay open, bytes wait (a partition that
                TCP rides out once it heals)
            ──► cut(): every connection is reset now and new ones are refused
            ──► heal(): back to healthy
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time


class FaultyProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.delay_s, self.refusing = 0.0, False
        self._moving = threading.Event()
        self._moving.set()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    # ---- faults ------------------------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def stall(self) -> None:
        self._moving.clear()

    def cut(self) -> None:
        self.refusing = True
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):  # RST, not FIN: what a broken path looks like
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()

    def heal(self) -> None:
        self.delay_s, self.refusing = 0.0, False
        self._moving.set()

    def close(self) -> None:
        self.cut()
        self._listener.close()

    # ---- plumbing ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                self._moving.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
