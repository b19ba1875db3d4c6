"""Chaos under `baton up`, the one-command cluster most users run: `baton up --prefill 1
--decode 2` on the real model, a load of streaming clients with deadlines, and each role's
process SIGKILLed in turn. `baton up` must start it again and keep serving meanwhile; every
request must end by its deadline + 3 s with success (the engine's greedy output) or a typed
status; once quiet, every worker's KV pool must be free, with no lease. The same checks as
tests/chaos/test_faults.py, which runs the processes itself."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
from baton.engine.engine import LLMEngine

from tests.chaos.harness import Load, check, reference
from tests.support.reference import REFERENCE_POOL
from tests.support.up import Up

pytestmark = pytest.mark.chaos

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def want():
    return reference(LLMEngine.from_path(None, REFERENCE_POOL), MAX_TOKENS)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    # 256 blocks a worker (4,096 tokens: the four clients' streams, and a killed worker's
    # moved onto the other decode worker), not the default 1 GiB pool each start faults in
    u = Up(tmp_path_factory.mktemp("baton-up"), "--prefill", "1", "--decode", "2",
           "--num-blocks", "256", "--http-port", "-1",
           "--router-args", "--local-prefill-max-tokens 0 --stall-timeout 3")
    yield u
    assert u.stop() == 0, "".join(u.lines[-30:])


@pytest.mark.parametrize("role", ["decode", "prefill", "router"])
def test_baton_up_replaces_each_killed_role_under_load(up, want, role):
    load = Load(up, clients=4, deadline=30.0, max_tokens=MAX_TOKENS).start()
    load.wait_more(4)
    mark = len(up.lines)
    victim = up.pid_of(role)
    os.kill(victim, signal.SIGKILL)
    up.wait_line(r"exited \(-9\); starting it again", f"baton up notices the {role}", mark)
    up.wait_line(r"back:", f"the {role} is back", mark)
    # the clients' channel reconnects to the new router on its own backoff schedule (calls
    # meanwhile fail UNAVAILABLE at once): wait as a client would, then count
    grpc.channel_ready_future(up.router.channel).result(timeout=120)
    ended = len(load.outcomes)
    load.wait_more(8)  # served by the replacement too
    outcomes = load.stop()
    counts = check(f"baton up: SIGKILL {role}", outcomes, want)
    assert counts["OK"] > 0
    assert any(o.code == "OK" for o in outcomes[ended:]), "nothing served after the restart"
    assert up.pid_of(role) != victim
    up.assert_quiet(workers=3)
