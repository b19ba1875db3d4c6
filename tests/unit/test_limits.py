"""The router's admission limits: slots, the bounded first-come-first-served queue, per-key caps,
and waiters that give up (deadline, client gone) without taking or leaking a slot."""

from __future__ import annotations

import threading
import time

import pytest
from baton.services.router.limits import (
    Admission,
    DecodeQueue,
    LimitExceededError,
    Limits,
    PoolFullError,
    WaitEndedError,
    WaitLine,
)


def no_deadline():
    return None


def active():
    return True


def hold(adm: Admission, key: str, release: threading.Event, order: list, name: str):
    """A thread that takes a slot, records ``name`` when it got it, and holds it until
    ``release`` is set; returns the thread (started)."""
    def run():
        with adm.slot(key, no_deadline, active):
            order.append(name)
            release.wait(10)
    t = threading.Thread(target=run)
    t.start()
    return t


def admit(adm: Admission, key: str, remaining=no_deadline, is_active=active) -> None:
    with adm.slot(key, remaining, is_active):
        pass


def wait_for(cond, what: str = "the condition"):
    """Until ``cond()``; the bound is a hang detector, not a timing assertion."""
    end = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.005)


def test_slots_then_queue_then_refusal_naming_the_limit():
    adm = Admission(Limits(max_concurrent=2, max_queued=1))
    release, order = threading.Event(), []
    ts = [hold(adm, f"k{i}", release, order, f"r{i}") for i in range(2)]
    wait_for(lambda: adm.stats()["running"] == 2)
    queued = hold(adm, "k9", release, order, "queued")
    wait_for(lambda: adm.stats()["waiting"] == 1)
    with pytest.raises(LimitExceededError) as e:
        admit(adm, "k8")
    assert e.value.limit == "max_queued" and "max_queued=1" in str(e.value)
    assert adm.stats()["refused"] == 1
    release.set()
    for t in [*ts, queued]:
        t.join(5)
    assert order[-1] == "queued"
    assert adm.stats() == {"running": 0, "waiting": 0, "refused": 1, "keys": 0}


def test_waiters_are_served_first_come_first_served():
    adm = Admission(Limits(max_concurrent=1, max_queued=10))
    gate, order = threading.Event(), []
    first = hold(adm, "a", gate, order, "first")
    wait_for(lambda: adm.stats()["running"] == 1)
    done = threading.Event()
    done.set()  # the waiters hold their slot only briefly, one at a time
    waiters = []
    for i in range(5):
        waiters.append(hold(adm, "b", done, order, f"w{i}"))
        wait_for(lambda i=i: adm.stats()["waiting"] == i + 1)
    gate.set()
    for t in [first, *waiters]:
        t.join(5)
    assert order == ["first", "w0", "w1", "w2", "w3", "w4"]


def test_per_key_cap_counts_waiting_requests_too():
    adm = Admission(Limits(max_concurrent=1, max_queued=5, max_concurrent_per_key=2))
    release, order = threading.Event(), []
    a1 = hold(adm, "alice", release, order, "a1")
    wait_for(lambda: adm.stats()["running"] == 1)
    a2 = hold(adm, "alice", release, order, "a2")  # waits in line, and counts for alice
    wait_for(lambda: adm.stats()["waiting"] == 1)
    with pytest.raises(LimitExceededError) as e:
        admit(adm, "alice")
    assert e.value.limit == "max_concurrent_per_key"
    bob = hold(adm, "bob", release, order, "bob")  # another key still gets in line
    wait_for(lambda: adm.stats()["waiting"] == 2)
    release.set()
    for t in (a1, a2, bob):
        t.join(5)
    assert sorted(order) == ["a1", "a2", "bob"] and adm.stats()["keys"] == 0


def test_a_waiter_whose_deadline_passes_or_client_leaves_frees_its_place():
    adm = Admission(Limits(max_concurrent=1, max_queued=2, max_concurrent_per_key=3))
    release, order = threading.Event(), []
    holder = hold(adm, "k", release, order, "holder")
    wait_for(lambda: adm.stats()["running"] == 1)
    end = time.monotonic() + 0.2
    with pytest.raises(WaitEndedError, match="deadline"):
        admit(adm, "k", lambda: end - time.monotonic())
    gone = threading.Event()
    threading.Timer(0.1, gone.set).start()
    with pytest.raises(WaitEndedError, match="went away"):
        admit(adm, "k", is_active=lambda: not gone.is_set())
    assert adm.stats() == {"running": 1, "waiting": 0, "refused": 0, "keys": 1}
    release.set()
    holder.join(5)
    assert adm.stats()["keys"] == 0


def test_no_limits_admit_everyone_and_errors_in_the_body_free_the_slot():
    adm = Admission(Limits())
    with pytest.raises(RuntimeError), adm.slot("k", no_deadline, active):
        raise RuntimeError("the request failed")
    assert adm.stats()["running"] == 0
    with pytest.raises(ValueError, match="max_queued=-1"):
        Limits(max_queued=-1)


def test_api_keys_accept_only_the_listed_bearer_tokens(tmp_path):
    from baton.services.router.limits import ApiKeys

    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha-key\n\n  beta-key  \n")
    keys = ApiKeys.load("gamma-key", str(f))
    assert len(keys) == 3 and keys
    assert all(keys.allows(f"Bearer {k}") for k in ("alpha-key", "beta-key", "gamma-key"))
    for bad in (None, "", "alpha-key", "Bearer ", "Bearer alpha", "Bearer alpha-key2",
                "bearer alpha-key", "Basic alpha-key"):
        assert not keys.allows(bad), bad
    assert not ApiKeys.load(None, None)


class Pool:
    """A decode pool of ``slots`` running-batch slots, as routing sees it: ``pick`` takes one
    or raises PoolFullError; ``end`` frees one and wakes the queue, as a request's end does."""

    def __init__(self, queue: DecodeQueue, slots: int) -> None:
        self.queue, self.free, self.lock = queue, slots, threading.Lock()
        self.picks = 0

    def pick(self):
        with self.lock:
            self.picks += 1
            if not self.free:
                raise PoolFullError("every decode worker runs its --max-num-seqs requests")
            self.free -= 1
            return "decode-0"

    def end(self):
        with self.lock:
            self.free += 1
        self.queue.wake()


def test_the_decode_queue_holds_requests_first_come_first_served_and_refuses_past_its_bound():
    q = DecodeQueue(max_queued=2, recheck_s=30)  # only a wake (a request's end) lets one in
    pool = Pool(q, slots=1)
    assert q.first(pool.pick, lambda: 60.0, active) == "decode-0"  # a free slot: at once
    got: list[str] = []

    def waiter(name):
        q.first(pool.pick, lambda: 60.0, active)
        got.append(name)

    threads = []
    for name in ("a", "b"):  # in this order
        threads.append(threading.Thread(target=waiter, args=(name,)))
        threads[-1].start()
        n = len(threads)
        wait_for(lambda n=n: q.waiting() == n, f"{name} waits")
    with pytest.raises(LimitExceededError) as e:  # a third would wait: refused at once
        q.first(pool.pick, lambda: 60.0, active)
    assert e.value.limit == "max_queued" and "decode" in str(e.value) and q.refused == 1
    assert got == []
    pool.end()  # one request ends: the head of the line takes its slot
    wait_for(lambda: got == ["a"], "a gets the freed slot")
    assert q.waiting() == 1
    pool.end()
    wait_for(lambda: got == ["a", "b"], "b gets the next one")
    for t in threads:
        t.join(60)
    assert q.waiting() == 0 and pool.free == 0


def test_a_decode_queue_waiter_gives_up_at_its_deadline_or_when_its_client_leaves():
    q = DecodeQueue(max_queued=4, recheck_s=0.01)
    pool = Pool(q, slots=0)
    left = iter([60.0, 60.0, 0.0])  # the deadline passes while it waits
    with pytest.raises(WaitEndedError, match="deadline passed.*decode slot"):
        q.first(pool.pick, lambda: next(left, 0.0), active)
    gone = threading.Event()
    t = threading.Thread(target=lambda: (wait_for(lambda: q.waiting() == 1, "waits"),
                                         gone.set()))
    t.start()
    with pytest.raises(WaitEndedError, match="client went away"):
        q.first(pool.pick, lambda: 60.0, lambda: not gone.is_set())
    t.join(60)
    assert q.waiting() == 0  # neither left its place behind
    pool.end()
    assert q.first(pool.pick, lambda: 60.0, active) == "decode-0"


def test_only_the_head_of_the_decode_queue_wakes_to_look_again():
    """The head looks again every recheck_s; the others sleep until their turn (their client
    checked every idle_check_s, here longer than the test), so a long line does not cost the
    router a wake-up per waiter per recheck. The order stays first come, first served."""
    q = DecodeQueue(max_queued=64, recheck_s=0.01, idle_check_s=600)
    pool = Pool(q, slots=0)
    checks: dict[str, int] = {}
    got: list[str] = []

    def waiter(name):
        def still_wanted() -> bool:
            checks[name] = checks.get(name, 0) + 1
            return True
        q.first(pool.pick, lambda: 60.0, still_wanted)
        got.append(name)

    names = [f"w{i}" for i in range(8)]
    threads = []
    for i, name in enumerate(names):
        threads.append(threading.Thread(target=waiter, args=(name,)))
        threads[-1].start()
        wait_for(lambda i=i: q.waiting() == i + 1, f"{name} waits")
    looked = pool.picks
    wait_for(lambda: pool.picks >= looked + 50, "the head looks again, every recheck_s")
    assert checks["w0"] >= 50  # the head: once per look
    assert all(checks[n] == 1 for n in names[1:]), checks  # the rest: asleep since they came
    for k, name in enumerate(names):  # each end lets the next one in, in arrival order
        pool.end()
        wait_for(lambda k=k: len(got) == k + 1, f"{name} gets a slot")
    assert got == names
    for t in threads:
        t.join(60)
    assert q.waiting() == 0


def test_only_the_head_of_the_admission_queue_wakes_to_look_again():
    """As in the decode queue: the head checks its client every recheck_s, the others sleep
    until their turn (every idle_check_s, here longer than the test), and a freed slot goes
    to the head at once, in arrival order."""
    adm = Admission(Limits(max_concurrent=1, max_queued=16))
    adm.recheck_s, adm.idle_check_s = 0.01, 600
    gate, order = threading.Event(), []
    first = hold(adm, "a", gate, order, "first")
    wait_for(lambda: adm.stats()["running"] == 1)
    checks: dict[str, int] = {}
    names = [f"w{i}" for i in range(6)]
    steps = {n: threading.Event() for n in names}

    def waiter(name):
        def still_wanted() -> bool:
            checks[name] = checks.get(name, 0) + 1
            return True
        with adm.slot("b", no_deadline, still_wanted):
            order.append(name)
            steps[name].wait(60)

    threads = []
    for i, name in enumerate(names):
        threads.append(threading.Thread(target=waiter, args=(name,)))
        threads[-1].start()
        wait_for(lambda i=i: adm.stats()["waiting"] == i + 1, f"{name} waits")
    wait_for(lambda: checks.get("w0", 0) >= 50, "the head checks its client every recheck_s")
    assert all(checks[n] == 1 for n in names[1:]), checks  # the rest: asleep since they came
    gate.set()
    for name in names:
        wait_for(lambda name=name: order[-1] == name, f"{name} gets the slot")
        steps[name].set()
    for t in [first, *threads]:
        t.join(60)
    assert order == ["first", *names]
    assert adm.stats() == {"running": 0, "waiting": 0, "refused": 0, "keys": 0}


def test_a_wait_line_wakes_only_its_head_and_hands_the_turn_on_when_the_head_leaves():
    line = WaitLine()
    a, b, c = line.join(), line.join(), line.join()
    assert len(line) == 3 and line.is_head(a) and not line.is_head(b)
    assert line.nap_s(a, 0.05, 0.5) == 0.05 and line.nap_s(c, 0.05, 0.5) == 0.5
    line.wake_head()
    assert a.is_set() and not b.is_set() and not c.is_set()
    line.leave(b)  # not first: nobody else is woken
    assert not c.is_set() and len(line) == 2
    line.leave(a)  # first: the next in line looks at once
    assert c.is_set() and line.is_head(c)
    line.leave(c)
    assert len(line) == 0
    line.wake_head()  # an empty line: nothing to wake, no error
