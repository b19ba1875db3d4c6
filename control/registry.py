"""The worker registry in Redis: who serves which role, where, with which model.

Each worker owns one key, ``baton:worker:<worker id>``, holding its record as JSON with a TTL;
a heartbeat thread rewrites it every ``ttl / 3``. A worker that dies stops renewing and vanishes
from the registry within ``ttl`` seconds; a draining worker deletes its key first thing, so
routers stop sending it work before it stops serving. No other state: routers list the keys.
Routers register the same way under ``baton:router:<router id>`` (for ``baton status``).

    baton:worker:prefill-127.0.0.1-40001  ->  {"worker_id": ..., "role": "prefill",
                                              "address": "127.0.0.1:40001", "fingerprint": ...,
                                              "incarnation": ..., "model": ..., "started_at": ...,
                                              "block_size": 16,
                                              "metrics_address": "127.0.0.1:40002"}
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field, fields

from redis.exceptions import AuthenticationError, AuthorizationError, RedisError

log = logging.getLogger("baton.control")

PREFIX = "baton:worker:"
ROUTER_PREFIX = "baton:router:"
ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    role: str  # prefill | decode | both
    address: str  # host:port of its gRPC server
    fingerprint: str
    incarnation: str
    model: str = ""
    started_at: float = field(default_factory=time.time)
    block_size: int = 16  # tokens per KV block: routers hash prompts with it
    metrics_address: str = ""  # host:port of its Prometheus /metrics ("" when it serves none)
    max_num_seqs: int = 0  # its running batch's size (--max-num-seqs); 0: not told (older)
    # its tensor-parallel group: "2 ranks on cpu (pids 10 11)"; "" from older workers
    ranks: str = ""
    role_epoch: int = 0  # role switches this worker process has made (`baton role`)
    dtype: str = ""  # its weights' and KV cache's precision (--dtype); "" from older workers
    num_blocks: int = 0  # its KV pool's blocks (--num-blocks, or what the device left); 0: older
    threads: int = 0  # its torch threads on a CPU (--threads, or torch's default); 0: GPU, older
    # what computes: the GPU's name, or the CPU's model and speed flags
    # (baton.engine.config.processor); "" from older workers
    processor: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {ROLES}")

    @property
    def key(self) -> str:
        return PREFIX + self.worker_id


@dataclass(frozen=True)
class RouterRecord:
    router_id: str
    address: str  # its public gRPC API
    http_address: str = ""  # the OpenAI-compatible HTTP front and /metrics ("" when none)
    model: str = ""
    tls: bool = False  # the HTTP front speaks https
    started_at: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        return ROUTER_PREFIX + self.router_id


def _from_json(cls, raw):
    """A record from its JSON, ignoring fields this version does not know (a newer peer's)."""
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


class WorkerRegistry:
    """Reads and writes worker records. ``client`` is a ``redis.Redis``."""

    def __init__(self, client, ttl_s: float = 10.0) -> None:
        if ttl_s < 1:
            raise ValueError(f"registry ttl_s={ttl_s} must be >= 1 second")
        self.redis, self.ttl_s = client, ttl_s

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 10.0) -> WorkerRegistry:
        from baton.control.redis_client import connect

        return cls(connect(url, socket_timeout=5), ttl_s)

    def put(self, record: WorkerRecord | RouterRecord) -> None:
        self.redis.set(record.key, json.dumps(asdict(record)), px=int(self.ttl_s * 1000))

    def remove(self, worker_id: str) -> None:
        self.redis.delete(PREFIX + worker_id)

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Live workers (of ``role``; a ``both`` worker counts for prefill and decode too)."""
        return [rec for rec in self._read(PREFIX, WorkerRecord)
                if role is None or rec.role == role or (rec.role == "both" and role != "both")]

    def routers(self) -> list[RouterRecord]:
        """Live routers."""
        return self._read(ROUTER_PREFIX, RouterRecord)

    def _read(self, prefix: str, cls) -> list:
        keys = sorted(self.redis.scan_iter(match=prefix + "*", count=500))
        values = self.redis.mget(keys) if keys else []
        # None: expired between SCAN and MGET
        return [_from_json(cls, raw) for raw in values if raw is not None]


class Registration:
    """A worker's own entry: put at start, renewed by a heartbeat thread, removed on drain.

    Redis being away never stops the process: at start it serves unregistered and the heartbeat
    registers it when Redis answers; a Redis that comes back empty (restarted without
    persistence, or a failover to a replica that had not caught up) has the entry again within
    a heartbeat (a third of the TTL). ``down_since`` is when the heartbeat last started failing
    (None while it succeeds)."""

    def __init__(self, registry: WorkerRegistry, record: WorkerRecord | RouterRecord) -> None:
        self.registry, self.record = registry, record
        self.down_since: float | None = None
        self.num_failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="registry-heartbeat",
                                        daemon=True)

    def start(self) -> Registration:
        """Register (or, with Redis away, start the heartbeat that will). Credentials Redis
        refuses are a configuration error, not an outage: AuthenticationError is raised."""
        self._put(first=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.registry.ttl_s / 3):
            self._put()

    def update(self, record: WorkerRecord | RouterRecord) -> bool:
        """Renew with ``record`` from now on, written at once; False while Redis is away (it
        is written when Redis answers again)."""
        self.record = record
        self._put()
        return self.down_since is None

    def _put(self, first: bool = False) -> None:
        try:
            self.registry.put(self.record)
        except (AuthenticationError, AuthorizationError):
            if first:
                raise
            self.num_failures += 1
            log.error("Redis refuses %s's credentials", self.record.key)
        except (RedisError, OSError) as e:  # Redis away: serve on, register when it is back
            self.num_failures += 1
            if self.down_since is None:
                self.down_since = time.time()
                log.warning("Redis unreachable (%s): %s is not in the registry until it "
                            "answers (retrying every %.1fs)", e, self.record.key,
                            self.registry.ttl_s / 3)
            return
        if self.down_since is not None:
            log.info("Redis answers again: %s registered (after %.0fs without)",
                     self.record.key, time.time() - self.down_since)
            self.down_since = None

    def withdraw(self) -> None:
        """Stop the heartbeat and delete the entry (first step of a drain)."""
        self._stop.set()
        try:
            self.registry.redis.delete(self.record.key)
        except (RedisError, OSError) as e:
            log.warning("could not deregister %s: %s (its entry expires in %.0fs)",
                        self.record.key, e, self.registry.ttl_s)
