"""The prefill/decode decision: whether the chosen decode worker prefills a prompt itself
(``local``) or a prefill worker does (``remote``). One function, used by the router
(``baton.services.router.routing``) and by the simulator behind ``baton tune``
(``baton.control.sim``), so what ``tune`` predicts is what the router does.

In order: no prefill worker to use -> local; few new tokens (at most ``local_max_new_tokens``,
prefix-cache hits excluded) -> local; every prefill worker saturated and the prompt short enough
for a decode worker to prefill without stalling its streams (at most ``saturated_local_max``)
-> local; otherwise remote.
"""

from __future__ import annotations

# The router's default scorer weights with the index (`baton router --scorers`) and what a
# block in a KV tier is worth against one in the pool: here, beside the P/D decision, because
# the router (services/router/routing.py) and the simulator (control/sim.py) both use them.
DEFAULT_SCORER_WEIGHTS = {"prefix": 3.0, "inflight": 1.0, "queue": 1.0, "kv": 0.5,
                          "prefill": 1.0}
DEFAULT_TIER_WEIGHTS = {"host": 0.95, "disk": 0.8}
# the ``prefill`` scorer's scale: a worker with this many prompt tokens still to compute scores
# 1/2, as one with one request in flight does on ``inflight``
PREFILL_SCORE_TOKENS = 1024


def prefill_score(tokens: int | None) -> float:
    """The ``prefill`` scorer: 1 / (1 + prompt tokens the worker has still to compute / 1,024);
    1 where the worker publishes no such count (the router then leaves the term out of the
    decision: ``RoutingPolicy._pick``). A request count shows a worker that prefills a
    2,000-token prompt as loaded as one decoding a short answer, and a short prompt sent there
    waits for that prefill (on a 2-vCPU VM, seconds)."""
    return 1.0 / (1 + (tokens or 0) / PREFILL_SCORE_TOKENS)

# reasons, per path
FEW_NEW_TOKENS = "few-new-tokens"  # local: the decode worker lacks at most the threshold
NO_PREFILL_WORKER = "no-prefill-worker"  # local: none registered (or all failed / colocated)
PREFILL_SATURATED = "prefill-saturated"  # local: every prefill worker is at its limit and
# the prompt is short enough for a decode worker to prefill without stalling its streams
MANY_NEW_TOKENS = "many-new-tokens"  # remote


def saturated_limit(saturated_local_max_tokens: int) -> float:
    """``--saturated-local-max-tokens`` as a bound: below 0 means any length."""
    return saturated_local_max_tokens if saturated_local_max_tokens >= 0 else float("inf")


def pd_path(new_tokens: int, prefill_available: bool, prefill_saturated: bool,
            local_max_new_tokens: int, saturated_local_max: float) -> tuple[str, str]:
    """(path, reason): ``path`` is "local" or "remote", ``reason`` one of the constants above.
    ``new_tokens``: prompt tokens the decode worker does not hold; ``prefill_saturated``: every
    usable prefill worker is at its saturation limit."""
    if not prefill_available:
        return "local", NO_PREFILL_WORKER
    if new_tokens <= local_max_new_tokens:
        return "local", FEW_NEW_TOKENS
    if prefill_saturated and new_tokens <= saturated_local_max:
        return "local", PREFILL_SATURATED
    return "remote", MANY_NEW_TOKENS
