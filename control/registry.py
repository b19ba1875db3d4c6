"""The worker registry in Redis: who serves which role, where, with which model.

Each worker owns one key, ``baton:worker:<worker id>``, holding its record as JSON with a TTL;
a heartbeat thread rewrites it every ``ttl / 3``. A worker that dies stops renewing and vanishes
from the registry within ``ttl`` seconds; a draining worker deletes its key first thing, so
routers stop sending it work before it stops serving. No other state: routers list the keys.

    baton:worker:prefill-127.0.0.1-40001  ->  {"worker_id": ..., "role": "prefill",
                                              "address": "127.0.0.1:40001", "fingerprint": ...,
                                              "incarnation": ..., "model": ..., "started_at": ...,
                                              "block_size": 16}
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field

from redis.exceptions import RedisError

log = logging.getLogger("baton.control")

PREFIX = "baton:worker:"
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

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {ROLES}")


class WorkerRegistry:
    """Reads and writes worker records. ``client`` is a ``redis.Redis``."""

    def __init__(self, client, ttl_s: float = 10.0) -> None:
        if ttl_s < 1:
            raise ValueError(f"registry ttl_s={ttl_s} must be >= 1 second")
        self.redis, self.ttl_s = client, ttl_s

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 10.0) -> WorkerRegistry:
        import redis

        return cls(redis.Redis.from_url(url, socket_timeout=5), ttl_s)

    def put(self, record: WorkerRecord) -> None:
        self.redis.set(PREFIX + record.worker_id, json.dumps(asdict(record)),
                       px=int(self.ttl_s * 1000))

    def remove(self, worker_id: str) -> None:
        self.redis.delete(PREFIX + worker_id)

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Live workers (of ``role``; a ``both`` worker counts for prefill and decode too)."""
        keys = sorted(self.redis.scan_iter(match=PREFIX + "*", count=500))
        values = self.redis.mget(keys) if keys else []
        out = []
        for raw in values:
            if raw is None:  # expired between SCAN and MGET
                continue
            rec = WorkerRecord(**json.loads(raw))
            if role is None or rec.role == role or (rec.role == "both" and role != "both"):
                out.append(rec)
        return out


class Registration:
    """A worker's own entry: put at start, renewed by a heartbeat thread, removed on drain."""

    def __init__(self, registry: WorkerRegistry, record: WorkerRecord) -> None:
        self.registry, self.record = registry, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="registry-heartbeat",
                                        daemon=True)

    def start(self) -> Registration:
        self.registry.put(self.record)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.registry.ttl_s / 3):
            try:
                self.registry.put(self.record)
            except (RedisError, OSError) as e:  # Redis away for a moment: the TTL decides
                log.warning("registry heartbeat for %s failed: %s", self.record.worker_id, e)

    def withdraw(self) -> None:
        """Stop the heartbeat and delete the entry (first step of a drain)."""
        self._stop.set()
        try:
            self.registry.remove(self.record.worker_id)
        except (RedisError, OSError) as e:
            log.warning("could not deregister %s: %s (its entry expires in %.0fs)",
                        self.record.worker_id, e, self.registry.ttl_s)
