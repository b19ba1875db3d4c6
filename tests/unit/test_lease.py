"""The lease table pins the hand-off contract: a release says intact only if the lease never
ended before it; every ended lease is handed back exactly once for its blocks to be freed."""

from __future__ import annotations

import pytest
from baton.transfer.lease import LeaseTable


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def table():
    clock = Clock()
    return LeaseTable(ttl_s=10.0, clock=clock), clock


def test_release_in_time_is_intact_and_returns_the_blocks(table):
    leases, clock = table
    lease = leases.grant("r1", (4, 5, 6))
    assert lease.expires_at == 1010.0 and len(lease.lease_id) == 24
    clock.t = 1009.9
    r = leases.release(lease.lease_id)
    assert r.intact and r.reason == "" and r.lease == lease
    assert len(leases) == 0 and leases.num_released == 1 and leases.num_expired == 0
    again = leases.release(lease.lease_id)  # a retried release cannot free the blocks twice
    assert not again.intact and again.lease is None and again.reason == "released"


def test_swept_expiry_frees_once_and_a_late_release_is_refused(table):
    leases, clock = table
    a = leases.grant("a", (1,))
    clock.t = 1005.0
    b = leases.grant("b", (2,))
    clock.t = 1010.0  # a's expiry exactly
    assert leases.pop_expired() == [a]
    assert leases.pop_expired() == []
    late = leases.release(a.lease_id)
    assert not late.intact and late.lease is None and "expired" in late.reason
    assert leases.release(b.lease_id).intact
    assert leases.num_expired == 1 and leases.num_granted == 2


def test_release_after_expiry_but_before_the_sweep_is_not_intact(table):
    leases, clock = table
    lease = leases.grant("r", (7, 8))
    clock.t = 1010.5
    r = leases.release(lease.lease_id)
    # the blocks were never reused (no sweep ran), but the reader cannot know that the holder
    # did not free them: the expiry is the contract. The caller still frees them, once.
    assert not r.intact and r.lease == lease and "expired" in r.reason
    assert leases.pop_expired() == []


def test_unknown_and_revoked_leases(table):
    leases, _ = table
    r = leases.release("feedbeef")
    assert not r.intact and r.lease is None and "unknown lease" in r.reason
    lease = leases.grant("r", (3,))
    assert leases.revoke(lease.lease_id, "the holder shut down") == lease
    assert leases.revoke(lease.lease_id, "again") is None
    late = leases.release(lease.lease_id)
    assert not late.intact and late.reason == "the holder shut down"


def test_revoke_all_and_bounded_memory_of_ended_leases():
    clock = Clock()
    leases = LeaseTable(ttl_s=1.0, clock=clock, remember=3)
    granted = [leases.grant(f"r{i}", (i,)) for i in range(5)]
    revoked = leases.revoke_all("shutdown")
    assert sorted(x.request_id for x in revoked) == [f"r{i}" for i in range(5)]
    assert len(leases) == 0
    assert leases.release(granted[4].lease_id).reason == "shutdown"
    assert "unknown lease" in leases.release(granted[0].lease_id).reason  # forgotten (bounded)


def test_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl_s=0"):
        LeaseTable(ttl_s=0)

