"""The orchestrator through whole requests against scripted workers (tests/support/fake_pool.py):
retry, migration, a stalled stream, the deadline and cancellation, each seen as the client sees
it (the messages and the typed error) and as the workers see it (the calls made, the leases
given back). No processes; the routing policy, limits and stall watch are the real ones."""

from __future__ import annotations

import threading

import pytest
from baton.control.registry import WorkerRecord
from baton.engine.tokenizer import BatonTokenizer
from baton.services.router.errors import RequestError, Status
from baton.services.router.orchestrator import (
    Cancellation,
    Deadline,
    Orchestrator,
    RouterSettings,
)
from baton.services.router.routing import RoutingPolicy
from baton_client.v1 import api_pb2

from tests.support.fake_pool import HANG, FakeWorkerPool, chunk, prefilled

PROMPT = list(range(5, 45))  # 40 tokens


def record(worker_id: str, role: str, port: int) -> WorkerRecord:
    return WorkerRecord(worker_id, role, f"10.0.0.1:{port}", "fp", "inc-" + worker_id,
                        block_size=4)


P1, P2 = record("p1", "prefill", 1), record("p2", "prefill", 2)
D1, D2 = record("d1", "decode", 11), record("d2", "decode", 12)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return BatonTokenizer.from_hf_dir(tiny_llama[0], (2,))


def orchestrator(tokenizer, workers, scripts, *, local: bool = False, **settings):
    pool = FakeWorkerPool(workers, scripts)
    policy = RoutingPolicy(pool, None, mode="least-loaded",
                           local_max_new_tokens=10_000 if local else 0)
    s = RouterSettings(model="tiny", max_model_len=512, fingerprint="fp", **settings)
    return Orchestrator(pool, tokenizer, s, policy), pool


def request(max_tokens: int = 4) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=PROMPT),
                                   params=api_pb2.SamplingParams(max_tokens=max_tokens))


def run(orch, req=None, deadline_s: float = 60.0, cancel: Cancellation | None = None):
    """Every message of the request: (token ids of the deltas, the final message)."""
    tokens, final = [], None
    for msg in orch.generate(req or request(), Deadline.after(deadline_s),
                             cancel or Cancellation()):
        if msg.HasField("delta"):
            tokens += msg.delta.token_ids
        else:
            final = msg.final
    return tokens, final


def test_a_remote_request_prefills_hands_off_and_relays_the_decode(tokenizer):
    orch, pool = orchestrator(tokenizer, [P1, D1], {
        "p1": [prefilled(7, P1)],
        "d1": [[chunk([7]), chunk([8, 9]), chunk([10], finish_reason="length")]]})
    tokens, final = run(orch)
    assert tokens == [7, 8, 9, 10]
    assert (final.path, final.prefill_worker, final.decode_worker) == ("remote", "p1", "d1")
    assert (final.finish_reason, final.retries, final.migrations) == ("length", 0, 0)
    assert pool.kinds() == [("p1", "prefill"), ("d1", "decode")]
    decode_req = pool.calls[1][2]
    assert decode_req.first_token_id == 7 and decode_req.handle.lease_id == "lease"
    assert list(decode_req.prompt_token_ids) == PROMPT
    assert pool.released == []  # the decode worker released it
    assert pool.inflight(P1.address) == pool.inflight(D1.address) == 0


def test_an_unavailable_prefill_worker_is_retried_on_another(tokenizer):
    orch, pool = orchestrator(tokenizer, [P1, P2, D1], {
        "p1": [Status.UNAVAILABLE], "p2": [prefilled(7, P2)],
        "d1": [[chunk([7, 8], finish_reason="length")]]}, max_retries=2)
    tokens, final = run(orch, request(2))
    assert tokens == [7, 8] and final.retries == 1 and final.prefill_worker == "p2"
    assert [k for k in pool.kinds() if k[1] == "prefill"] == [("p1", "prefill"),
                                                             ("p2", "prefill")]
    assert pool.forgotten >= 1  # the registry is re-read after a worker failed


def test_a_failed_hand_off_gives_the_lease_back_and_retries(tokenizer):
    orch, pool = orchestrator(tokenizer, [P1, D1, D2], {
        "p1": [prefilled(7, P1, lease="first"), prefilled(7, P1, lease="second")],
        "d1": [[Status.UNAVAILABLE]], "d2": [[chunk([7, 8], finish_reason="length")]]})
    tokens, final = run(orch, request(2))
    assert tokens == [7, 8] and final.retries == 1
    assert pool.released == ["first"]  # the abandoned handle, at once


def test_retries_are_bounded(tokenizer):
    orch, pool = orchestrator(tokenizer, [P1, P2, D1], {
        "p1": [Status.UNAVAILABLE], "p2": [Status.UNAVAILABLE]}, max_retries=1)
    with pytest.raises(RequestError) as e:
        run(orch)
    assert e.value.status is Status.UNAVAILABLE and "every attempt failed" in str(e.value)
    assert len(pool.calls) == 2


def test_a_decode_worker_lost_after_tokens_were_sent_is_migrated(tokenizer):
    orch, pool = orchestrator(tokenizer, [D1, D2], {
        "d1": [[chunk([7], "a"), chunk([8], "b"), Status.UNAVAILABLE]],
        "d2": [[chunk([9], "c"), chunk([10], "d", finish_reason="length")]]}, local=True)
    tokens, final = run(orch)
    assert tokens == [7, 8, 9, 10]  # nothing sent twice, nothing lost
    assert (final.path, final.migrations, list(final.migrated_from)) == ("migrated", 1, ["d1"])
    resumed = pool.calls[1][2]
    assert list(resumed.prompt_token_ids) == PROMPT + [7, 8]  # the prompt plus what was sent
    assert resumed.params.max_tokens == 2  # what is left of max_tokens
    assert final.usage.completion_tokens == 4


def test_a_stalled_stream_is_cancelled_and_migrated(tokenizer):
    orch, pool = orchestrator(tokenizer, [D1, D2], {
        "d1": [[chunk([7]), HANG]],
        "d2": [[chunk([8, 9, 10], finish_reason="length")]]}, local=True, stall_timeout_s=0.2)
    tokens, final = run(orch)
    assert tokens == [7, 8, 9, 10] and final.migrations == 1
    assert pool.streams[0].cancelled.is_set()  # the silent worker's call was cancelled


def test_a_client_slow_to_read_is_not_taken_for_a_stalled_worker(tokenizer):
    # the router hands each chunk to its client before it reads the worker's next (gRPC's
    # flow control holds it there while the client does not read): that wait is the
    # client's, so the stall watch must not cancel and migrate the worker's stream
    import time

    def read_slowly(orch):
        """Every message, the client not reading for 5x the stall timeout after the first
        delta (the watchdog looks every 50 ms)."""
        tokens, final = [], None
        for msg in orch.generate(request(), Deadline.after(60), Cancellation()):
            if msg.HasField("delta"):
                if not tokens:
                    time.sleep(1.0)
                tokens += msg.delta.token_ids
            else:
                final = msg.final
        return tokens, final

    orch, pool = orchestrator(tokenizer, [D1, D2], {
        "d1": [[chunk([7]), chunk([8]), chunk([9, 10], finish_reason="length")]],
        "d2": [[chunk([8, 9, 10], finish_reason="length")]]}, local=True, stall_timeout_s=0.2)
    tokens, final = read_slowly(orch)
    assert tokens == [7, 8, 9, 10]
    assert final.migrations == 0 and final.decode_worker == "d1"
    assert not pool.streams[0].cancelled.is_set() and len(pool.calls) == 1
    # and a worker that goes silent once the client reads again is still found out
    orch, pool = orchestrator(tokenizer, [D1, D2], {
        "d1": [[chunk([7]), HANG]],
        "d2": [[chunk([8, 9, 10], finish_reason="length")]]}, local=True, stall_timeout_s=0.2)
    tokens, final = read_slowly(orch)
    assert tokens == [7, 8, 9, 10] and final.migrations == 1
    assert pool.streams[0].cancelled.is_set()


def test_a_request_past_its_deadline_ends_deadline_exceeded(tokenizer):
    orch, pool = orchestrator(tokenizer, [D1], {"d1": [[HANG]]}, local=True)
    with pytest.raises(RequestError) as e:
        run(orch, deadline_s=0.3)
    # the worker call's timeout was what was left of the request's deadline
    assert e.value.status is Status.DEADLINE_EXCEEDED
    assert pool.streams[0].timeout <= 0.3 and len(pool.calls) == 1  # not retried
    assert pool.inflight(D1.address) == 0


def test_a_client_that_goes_away_cancels_the_call_in_flight(tokenizer):
    orch, pool = orchestrator(tokenizer, [D1], {"d1": [[chunk([7]), HANG]]}, local=True)
    cancel = Cancellation()
    got: list = []

    def client() -> None:
        try:
            run(orch, cancel=cancel)
        except RequestError as e:
            got.append(e)

    t = threading.Thread(target=client)
    t.start()
    while not pool.streams or not pool.streams[0].reached_hang.wait(0.05):
        pass
    cancel.cancel()
    t.join(60)
    assert pool.streams[0].cancelled.is_set()
    assert len(got) == 1 and got[0].status is Status.CANCELLED
    assert pool.inflight(D1.address) == 0


def test_a_stream_that_ends_without_a_finish_is_an_internal_error_not_success(tokenizer):
    orch, _ = orchestrator(tokenizer, [D1], {"d1": [[chunk([7]), chunk([8])]]}, local=True)
    with pytest.raises(RequestError) as e:
        run(orch)
    assert e.value.status is Status.INTERNAL and "unfinished" in str(e.value)


def test_the_first_token_that_finishes_the_request_needs_no_decode(tokenizer):
    orch, pool = orchestrator(tokenizer, [P1, D1], {
        "p1": [prefilled(2, P1, finish_reason="stop")], "d1": []})
    tokens, final = run(orch)
    assert tokens == [2] and final.finish_reason == "stop" and final.path == "remote"
    assert pool.kinds() == [("p1", "prefill")]
