"""`baton up`'s embedded Redis: on loopback it needs no password (only this machine's users
reach it); listening beyond loopback (`--host 0.0.0.0`, Ray) it requires a password generated
per cluster, which reaches the processes in the URL of their environment and is never printed.
Without it anyone who reached the port could rewrite the registry routers pick workers from."""

from __future__ import annotations

import os
import socket
import time
import types
from pathlib import Path

import pytest
import redis
from baton.cli import up
from baton.services.common.process import is_loopback


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("node-7.example", False)])
def test_which_hosts_are_loopback_only(host, loopback):
    assert is_loopback(host) is loopback  # the workers' UCX restriction uses it too


def test_an_embedded_redis_beyond_loopback_requires_a_generated_password(capsys):
    cluster = up._LocalCluster.__new__(up._LocalCluster)  # only what _start_redis reads
    cluster.a, cluster.t0 = types.SimpleNamespace(redis_url=None), time.monotonic()
    url = cluster._start_redis("0.0.0.0")
    try:
        password = cluster.redis.password
        assert password and len(password) >= 24 and f":{password}@" in url
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=cluster.redis.port).ping()
        assert redis.Redis(host="127.0.0.1", port=cluster.redis.port, password=password).ping()
        out = capsys.readouterr().out
        assert "password generated" in out and password not in out
    finally:
        cluster.redis.stop()
    url = cluster._start_redis("127.0.0.1")  # loopback: as before, no password
    try:
        assert cluster.redis.password is None
        assert redis.Redis(host="127.0.0.1", port=cluster.redis.port).ping()
    finally:
        cluster.redis.stop()


def test_a_redis_that_cannot_start_leaves_no_folder_behind():
    """A port already taken: redis-server exits at once, the error says why, and its working
    folder goes with it (`baton up` retrying a restart on a busy port left one per try)."""
    from baton.control.redis_server import EmbeddedRedis, RedisStartError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = EmbeddedRedis(port=taken.getsockname()[1])
        assert os.path.isdir(r._dir)
        with pytest.raises(RedisStartError, match="exited with"):
            r.start(timeout=30)
        assert not os.path.exists(r._dir)


def test_a_port_picked_free_but_taken_before_redis_binds_it_is_tried_again(monkeypatch):
    """The free port `EmbeddedRedis` picks can be another process's by the time redis-server
    binds it (a parallel test suite, an outbound connection): it starts again on another
    port, with a fresh folder, and says nothing; a port the caller gave is not changed."""
    from baton.control import redis_server
    from baton.control.redis_server import EmbeddedRedis, RedisStartError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        free = redis_server._free_port
        monkeypatch.setattr(redis_server, "_free_port",
                            lambda host: next(picks, None) or free(host))
        r = EmbeddedRedis()
        first_dir = r._dir
        r.start(timeout=30)
        try:
            assert r.port != busy and redis.Redis(host="127.0.0.1", port=r.port).ping()
            assert not os.path.exists(first_dir) and os.path.isdir(r._dir)
        finally:
            r.stop()
        assert not os.path.exists(r._dir)
        picks = iter([busy] * redis_server.PORT_TRIES)  # taken every time: the error says so
        r = EmbeddedRedis()
        with pytest.raises(RedisStartError, match="in use"):
            r.start(timeout=30)
        assert not os.path.exists(r._dir)


def test_a_redis_started_to_die_with_its_parent_goes_when_the_parent_is_killed():
    """`baton up` and `baton profile` start their redis-server so: a SIGKILL of them (no
    cleanup runs) still stops it, where before it ran on, idle, until someone killed it. Its
    pid is redis-server's own (the helper that asks Linux for the signal becomes it), which
    `baton up`'s supervision and the outage tests read."""
    import signal
    import subprocess
    import sys

    from tests.support.processes import alive

    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from baton.control.redis_server import "
         "EmbeddedRedis; r = EmbeddedRedis(die_with_parent=True).start(); "
         "print(r.proc.pid, r.port, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        pid, port = map(int, parent.stdout.readline().split())
        assert b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert redis.Redis(host="127.0.0.1", port=port).ping()
        parent.kill()
        parent.wait(30)
        end = time.monotonic() + 60  # a failure's limit: it exits at once
        while alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
        left = alive(pid)
    finally:
        parent.kill()
        parent.stdout.close()
    if left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "redis-server outlived the process that started it"
