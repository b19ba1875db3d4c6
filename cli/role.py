"""``baton role WORKER_ID prefill|decode|both``: switch a worker's role while it serves.

The worker's WorkerAdmin.SetRole (behind the cluster secret: $BATON_CLUSTER_SECRET, else a local
``baton up``'s on the same Redis, from its state file) answers once
it refuses new work of a dropped role and its registry entry says the new role; routers read
the registry within a second, and a call that reaches the worker in between is retried on
another worker before its first token, so no request fails. Running streams, leases and cached
blocks stay on the worker. A switch that would leave the cluster without a worker that decodes
(or, from a prefill pool of one, without one that prefills: then the decode workers prefill
themselves, which is allowed) is refused here, naming why.
"""

from __future__ import annotations

import argparse
import sys

from baton.control.registry import ROLES


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("worker_id", help="the worker, as `baton status` lists it")
    ap.add_argument("role", choices=ROLES, help="its role from now on")
    ap.add_argument("--redis-url", default=None,
                    help="the cluster's Redis (default $BATON_REDIS_URL, else the local "
                         "`baton up` cluster's)")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds to wait for the worker's answer (default 30)")


def refusal(workers: list, worker_id: str, role: str) -> str:
    """Why switching ``worker_id`` to ``role`` must not happen ("" when it may)."""
    ids = [w.worker_id for w in workers]
    if worker_id not in ids:
        return f"no worker {worker_id!r} is registered (registered: {', '.join(ids) or 'none'})"
    decoders = [w for w in workers if w.role in ("decode", "both")
                and (w.worker_id != worker_id or role in ("decode", "both"))]
    if not decoders:
        return (f"{worker_id} is the last worker that decodes: with it prefilling only, no "
                "request could be served")
    return ""


def cmd_role(a: argparse.Namespace) -> int:
    from baton.control.cluster_state import find_redis_url, up_secret
    from baton.control.redis_client import connect
    from baton.control.registry import WorkerRegistry
    from baton.control.tune_live import set_role
    from baton.transfer import cluster_secret
    from redis.exceptions import RedisError

    url = a.redis_url or find_redis_url()
    if not url:
        print("error: no cluster found: pass --redis-url (or set BATON_REDIS_URL)",
              file=sys.stderr)
        return 2
    cluster_secret.adopt(up_secret(url))  # a local `baton up`'s, unless the environment's
    try:
        workers = WorkerRegistry(connect(url, socket_timeout=3)).workers()
    except (RedisError, OSError) as e:
        print(f"error: cannot read the registry: {e}", file=sys.stderr)
        return 1
    why = refusal(workers, a.worker_id, a.role)
    if why:
        print(f"error: not switched: {why}", file=sys.stderr)
        return 1
    w = next(x for x in workers if x.worker_id == a.worker_id)
    try:
        r = set_role(w.address, a.role, a.timeout)
    except RuntimeError as e:
        print(f"error: {a.worker_id} at {w.address}: {e}", file=sys.stderr)
        return 1
    print(f"{a.worker_id}: {r.previous} -> {r.role}"
          + (f" (switch {r.epoch})" if r.previous != r.role else " (unchanged)"))
    return 0
