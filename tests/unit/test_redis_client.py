"""Redis URLs every Baton process takes: one server, or a master behind Sentinel (the failover
itself: tests/integration/test_redis_outage.py)."""

from __future__ import annotations

import pytest
from baton.control.redis_client import connect, parse_sentinel_url, redact


def test_sentinel_urls_name_the_sentinels_the_master_and_the_password():
    assert parse_sentinel_url("redis+sentinel://10.0.0.1:26379,s2:26380/mymaster") == (
        [("10.0.0.1", 26379), ("s2", 26380)], "mymaster", 0, None)
    assert parse_sentinel_url("redis+sentinel://:p%40ss@s1:26379/m/2") == (
        [("s1", 26379)], "m", 2, "p@ss")


@pytest.mark.parametrize("url, what", [
    ("redis+sentinel://s1:26379", "master_name"),
    ("redis+sentinel://s1/m", "not host:port"),
    ("redis+sentinel:///m", "master_name"),
])
def test_a_bad_sentinel_url_is_refused_naming_what_is_missing(url, what):
    with pytest.raises(ValueError, match=what):
        parse_sentinel_url(url)


def test_passwords_never_reach_a_log_line():
    assert redact("redis://:secret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis+sentinel://:secret@s:1/m") == "redis+sentinel://:***@s:1/m"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
    with pytest.raises(ValueError) as e:
        parse_sentinel_url("redis+sentinel://:secret@s1/m")
    assert "secret" not in str(e.value)


def test_a_plain_url_is_one_server_and_a_sentinel_url_a_master_for():
    assert type(connect("redis://127.0.0.1:1/0")).__name__ == "Redis"
    client = connect("redis+sentinel://127.0.0.1:1/m")
    assert "Sentinel" in type(client.connection_pool).__name__
