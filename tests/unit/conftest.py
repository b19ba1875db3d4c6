"""Fixtures the prefix-index and routing-policy tests share: a real redis-server per module,
a client on a flushed database per test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def server():
    from baton.control.redis_server import EmbeddedRedis

    with EmbeddedRedis() as r:
        yield r


@pytest.fixture
def client(server):
    import redis

    c = redis.Redis.from_url(server.url, socket_timeout=1)
    c.flushdb()
    return c
