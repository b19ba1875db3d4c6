"""Leases on a holder's KV blocks: the guarantee that a reader saw what was prefilled.

A prefill worker pins a finished prompt's blocks and grants a lease (random id, expiry). The reader
NIXL-READs the blocks, then releases the lease; the release answers ``intact=True`` only if the
lease was still held at that moment, that is, the blocks were never freed (so never overwritten)
between the grant and the end of the read. A lease that expires first (the reader vanished,
stalled, or was too slow) frees its blocks, and its late release answers ``intact=False`` with
the reason.

::

    grant ──────────── read (reader) ───────── release ─► intact: blocks freed now
    grant ─── read ────── expiry (sweep frees blocks) ── release ─► not intact: discard the read

Pure bookkeeping: freeing the blocks is the caller's job (``pop_expired`` / ``release`` return the
lease whose blocks to free). Thread-safe: releases arrive on RPC threads, sweeps on the engine's.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # unix seconds (the clock the handle carries)


@dataclass(frozen=True)
class ReleaseResult:
    intact: bool
    reason: str  # why not intact ("" when intact)
    lease: Lease | None  # the lease whose blocks the caller frees now (None if already freed)


class LeaseTable:
    """Active leases by id, plus a bounded memory of ended ones (to explain late releases)."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.time,
                 remember: int = 4096) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s={ttl_s} must be > 0")
        self.ttl_s, self._clock, self._remember = ttl_s, clock, remember
        self._active: dict[str, Lease] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # lease id -> why it ended
        self._lock = threading.Lock()
        self.num_granted = self.num_released = self.num_expired = 0

    def __len__(self) -> int:
        return len(self._active)

    def num_blocks(self) -> int:
        """Blocks pinned under active leases."""
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._active.values())

    def grant(self, request_id: str, block_ids: tuple[int, ...],
              ttl_s: float | None = None) -> Lease:
        lease = Lease(secrets.token_hex(12), request_id, tuple(block_ids),
                      self._clock() + (ttl_s or self.ttl_s))
        with self._lock:
            self._active[lease.lease_id] = lease
            self.num_granted += 1
        return lease

    def release(self, lease_id: str) -> ReleaseResult:
        """End a lease on the reader's request. Intact only if it had not ended before."""
        with self._lock:
            lease = self._active.pop(lease_id, None)
            if lease is None:
                why = self._ended.get(lease_id, "unknown lease (granted by another incarnation?)")
                return ReleaseResult(False, why, None)
            self.num_released += 1
            late = self._clock() >= lease.expires_at
            if late:  # expired but not swept yet: the blocks are still ours, but too late to say
                self.num_expired += 1  # intact; the contract is the expiry, not the sweep
                self._end(lease_id, f"expired at {lease.expires_at:.3f} before the release")
                return ReleaseResult(False, self._ended[lease_id], lease)
            self._end(lease_id, "released")
            return ReleaseResult(True, "", lease)

    def pop_expired(self) -> list[Lease]:
        """Remove and return every lease past its expiry (the caller frees their blocks)."""
        now = self._clock()
        with self._lock:
            gone = [lease for lease in self._active.values() if lease.expires_at <= now]
            for lease in gone:
                del self._active[lease.lease_id]
                self._end(lease.lease_id, f"expired at {lease.expires_at:.3f} before the release")
            self.num_expired += len(gone)
        return gone

    def revoke(self, lease_id: str, reason: str) -> Lease | None:
        """End a lease now (shutdown, fault injection). Its late release answers not intact."""
        with self._lock:
            lease = self._active.pop(lease_id, None)
            if lease is not None:
                self._end(lease_id, reason)
                self.num_expired += 1
            return lease

    def revoke_all(self, reason: str) -> list[Lease]:
        with self._lock:
            gone = list(self._active.values())
            self._active.clear()
            for lease in gone:
                self._end(lease.lease_id, reason)
            self.num_expired += len(gone)
        return gone

    def _end(self, lease_id: str, reason: str) -> None:
        self._ended[lease_id] = reason
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
