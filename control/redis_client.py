"""Every Redis client a Baton process opens, from one URL.

- ``redis://[:password@]host:port/db`` (``rediss://`` with TLS, ``unix://``): one server;
- ``redis+sentinel://[:password@]host1:port1[,host2:port2...]/master_name[/db]``: a Redis behind
  Sentinel. The client asks the sentinels for the current master on every (re)connect, so after
  a failover the next command reaches the promoted replica; the password (if any) is the
  master's, and the sentinels are asked without one. Everything Baton keeps (registry, prefix
  index, counters) is written and its Lua scripts run on the master.

Redis Cluster is not supported: one routing lookup reads many workers' keys in one script, and a
cluster would spread them over slots.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

SENTINEL_SCHEME = "redis+sentinel"


def connect(url: str, socket_timeout: float = 5.0, socket_connect_timeout: float | None = None):
    """A ``redis.Redis`` for ``url`` (see the module docstring), with these timeouts."""
    import redis

    connect_timeout = socket_connect_timeout if socket_connect_timeout is not None \
        else socket_timeout
    if not url.startswith(SENTINEL_SCHEME + "://"):
        return redis.Redis.from_url(url, socket_timeout=socket_timeout,
                                    socket_connect_timeout=connect_timeout)
    from redis.sentinel import Sentinel

    sentinels, master, db, password = parse_sentinel_url(url)
    sentinel = Sentinel(sentinels, socket_timeout=socket_timeout,
                        socket_connect_timeout=connect_timeout)
    return sentinel.master_for(master, db=db, password=password, socket_timeout=socket_timeout,
                               socket_connect_timeout=connect_timeout)


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """(sentinel addresses, master name, db, password) of a ``redis+sentinel://`` URL; a
    ValueError names what is missing."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"{redact(url)}: not a {SENTINEL_SCHEME}:// URL")
    hosts = parts.netloc.rsplit("@", 1)[-1]
    sentinels = []
    for hp in filter(None, hosts.split(",")):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{redact(url)}: sentinel {hp!r} is not host:port")
        sentinels.append((host, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path:
        raise ValueError(f"{redact(url)}: expected {SENTINEL_SCHEME}://host:port[,host:port]/"
                         "master_name[/db]")
    db = int(path[1]) if len(path) > 1 else 0
    password = unquote(parts.password) if parts.password else None
    return sentinels, path[0], db, password


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and errors)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)
