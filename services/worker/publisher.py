"""A worker's presence in Redis: its registry entry (a TTL lease renewed while it lives) and the
publisher of its prefix-cache events and load to the prefix index. Both only with
``--redis-url``."""

from __future__ import annotations

import logging

from baton.services.common.config import ServerSettings

log = logging.getLogger("baton.services")


def register(cfg: ServerSettings, role: str, worker_id: str, address: str,
             fingerprint: str, incarnation: str, model: str, block_size: int = 16,
             metrics_address: str = "", max_num_seqs: int = 0, ranks: str = "",
             dtype: str = "", num_blocks: int = 0, threads: int = 0, processor: str = ""):
    """Put this worker in the Redis registry (if ``--redis-url``); returns the Registration."""
    if not cfg.redis_url:
        return None
    from baton.control.registry import Registration, WorkerRecord, WorkerRegistry

    registry = WorkerRegistry.from_url(cfg.redis_url, cfg.registry_ttl)
    record = WorkerRecord(worker_id, role, address, fingerprint, incarnation, model,
                          block_size=block_size, metrics_address=metrics_address,
                          max_num_seqs=max_num_seqs, ranks=ranks, dtype=dtype,
                          num_blocks=num_blocks, threads=threads, processor=processor)
    from redis.exceptions import AuthenticationError, AuthorizationError

    try:
        reg = Registration(registry, record).start()
    except (AuthenticationError, AuthorizationError) as e:  # a wrong password is no outage
        from baton.control.redis_client import redact

        raise SystemExit(f"error: Redis at {redact(cfg.redis_url)} refused this worker's "
                         f"credentials (auth: {e}); check the password in --redis-url or "
                         "BATON_REDIS_URL") from None
    if reg.down_since is None:
        log.info("registered as %s (%s) in Redis", worker_id, role)
    return reg


def publish_index(cfg: ServerSettings, engine, worker_id: str, incarnation: str):
    """Publish the engine's prefix-cache events and load to the Redis prefix index (if
    ``--redis-url``), with the registry's TTL; returns the running IndexPublisher."""
    if not cfg.redis_url or engine.kv_events is None:
        return None
    from baton.control.prefix_index import IndexPublisher
    from baton.control.redis_client import connect

    client = connect(cfg.redis_url, socket_timeout=2)
    def load() -> tuple[int, int, int, int, int]:  # plain counter reads, safe off the engine
        s = engine.stats()  # thread
        return s.waiting, s.running, s.free_blocks, s.total_blocks, s.prefill_tokens

    return IndexPublisher(client, worker_id, incarnation, engine.kv_events, load,
                          ttl_s=cfg.registry_ttl).start()
