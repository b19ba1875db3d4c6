"""`baton up`'s embedded Redis: on loopback it needs no password (only this machine's users
reach it); listening beyond loopback (`--host 0.0.0.0`, Ray) it requires a password generated
per cluster, which reaches the processes in the URL of their environment and is never printed.
Without it anyone who reached the port could rewrite the registry routers pick workers from."""

from __future__ import annotations

import os
import socket
import time
import types

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
