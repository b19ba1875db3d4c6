"""The load generator's arithmetic on hand-made timings: per-request TTFT/TPOT/ITL, percentiles,
SLO attainment, the goodput search; and the workloads built from the shared traces."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from baton.bench import loadgen as lg
from baton.bench.common import pct

# the first rows of ../shared/data's traces (Azure CC-BY-4.0, Mooncake Apache-2.0), copied so
# the test runs wherever the checkout is
DATA = Path(__file__).resolve().parents[1] / "data"


def rec(sent, first, chunks, end, n, error=None):
    return lg.Record(10, n, sent, first, end, chunks, n, error)


def test_a_requests_latencies():
    r = rec(0.0, 0.5, [0.5, 0.7, 1.0, 1.5], 1.5, n=5)  # the last chunk carried two tokens
    assert r.ttft == 0.5 and r.e2e == 1.5
    assert r.tpot == pytest.approx(1.0 / 4)  # (1.5 - 0.5) / (5 - 1)
    assert r.itls() == pytest.approx([0.2, 0.3, 0.5])
    assert rec(0.0, 0.5, [0.5], 0.5, n=1).tpot is None  # one token: no TPOT
    assert rec(0.0, None, [], None, n=0, error="UNAVAILABLE").ttft is None


def test_the_routers_account_of_the_first_token_by_path():
    from types import SimpleNamespace as NS

    def result(path, **t):
        timing = dict(route_s=0.0, queue_s=0.0, prefill_s=0.0, transfer_s=0.0,
                      first_token_s=0.0)
        return NS(path=path, timing=NS(**{**timing, **t}))

    # remote: the prefill worker's queue is inside prefill_s; the rest is the decode worker's
    remote = lg.ttft_stages(result("remote", route_s=0.001, queue_s=0.2, prefill_s=0.5,
                                   transfer_s=0.01, first_token_s=0.6))
    assert remote == pytest.approx({"wait": 0.0, "route": 0.001, "queue": 0.2, "prefill": 0.3,
                                    "transfer": 0.01, "decode_first": 0.089})
    local = lg.ttft_stages(result("local", route_s=0.001, queue_s=0.1, first_token_s=0.4))
    assert local == pytest.approx({"wait": 0.0, "route": 0.001, "queue": 0.1, "prefill": 0.299})
    # the router's waits (its slots, a decode slot) come before routing, on either path: not
    # the decode worker's prefill nor its first step
    local = lg.ttft_stages(result("local", route_s=0.001, queue_s=0.1, first_token_s=0.7,
                                  admission_wait_s=0.1, decode_wait_s=0.2))
    assert local == pytest.approx({"wait": 0.3, "route": 0.001, "queue": 0.1, "prefill": 0.299})
    remote = lg.ttft_stages(result("remote", route_s=0.001, queue_s=0.2, prefill_s=0.5,
                                   transfer_s=0.01, first_token_s=0.85, decode_wait_s=0.25))
    assert remote["wait"] == pytest.approx(0.25)
    assert remote["decode_first"] == pytest.approx(0.089)

    recs = []
    for q in (0.1, 0.2, 0.3):
        r = rec(0.0, 1.0, [1.0, 2.0], 2.0, n=2)
        r.path = "remote"
        r.stages = lg.ttft_stages(result("remote", queue_s=q, prefill_s=q + 0.5,
                                         first_token_s=q + 0.6))
        recs.append(r)
    recs.append(rec(0.0, None, [], None, n=0, error="UNAVAILABLE"))  # not counted
    st = lg.summarize(recs, 10.0, 2.0, 1.0)["ttft_stages_s"]
    assert list(st) == ["remote"] and st["remote"]["requests"] == 3
    assert st["remote"]["queue"]["p50"] == pytest.approx(0.2)
    assert st["remote"]["prefill"]["mean"] == pytest.approx(0.5)
    assert st["remote"]["decode_first"]["p90"] == pytest.approx(0.1)
    assert "ttft_stages_s" not in lg.summarize(recs[3:], 1.0, 2.0, 1.0)  # peers: none


def test_percentiles_interpolate_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert pct(xs, 0.5) == 2.5
    assert pct(xs, 0) == 1.0 and pct(xs, 1.0) == 4.0
    assert pct(xs, 0.9) == pytest.approx(3.7)
    assert pct(list(range(101)), 0.99) == 99
    assert pct([], 0.5) is None
    s = lg.stats([3.0, 1.0, 2.0])
    assert (s["n"], s["mean"], s["p50"]) == (3, 2.0, 2.0)


def test_attainment_counts_failures_and_both_slos():
    records = [
        rec(0.0, 0.1, [0.1, 0.2], 0.2, n=2),  # meets both
        rec(0.0, 0.1, [0.1, 0.5], 0.5, n=2),  # TPOT 0.4 > 0.3
        rec(0.0, 0.9, [0.9, 1.0], 1.0, n=2),  # TTFT 0.9 > 0.5
        rec(0.0, 0.2, [0.2], 0.2, n=1),  # one token: TTFT alone decides
        rec(0.0, None, [], None, n=0, error="RESOURCE_EXHAUSTED"),
    ]
    s = lg.summarize(records, wall_s=2.0, ttft_slo=0.5, tpot_slo=0.3)
    assert s["attainment"] == pytest.approx(2 / 5)
    assert s["succeeded"] == 4 and s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["error_details"] == {}  # a target that gives no message (the HTTP ones)
    assert s["output_tokens_per_s"] == pytest.approx(7 / 2.0)
    assert s["ttft_s"]["n"] == 4 and s["tpot_s"]["n"] == 3
    assert s["ttft_s"]["p50"] == pytest.approx(0.15)


def test_each_kind_of_failure_keeps_its_first_message():
    # Baton's gRPC target keeps the router's message with the status, so a run's failures
    # say why (a stall, a full queue), not only which status
    first = rec(0.0, None, [], None, n=0, error="UNAVAILABLE")
    first.detail = "UNAVAILABLE: worker 127.0.0.1:1 failed after tokens were streamed"
    later = rec(1.0, None, [], None, n=0, error="UNAVAILABLE")
    later.detail = "UNAVAILABLE: every attempt failed"
    full = rec(2.0, None, [], None, n=0, error="RESOURCE_EXHAUSTED")
    full.detail = "RESOURCE_EXHAUSTED: LimitExceededError: 1024 waiting"
    s = lg.summarize([first, later, full, rec(0.0, 0.1, [0.1], 0.1, n=1)], 3.0, 1.0, 1.0)
    assert s["errors"] == {"UNAVAILABLE": 2, "RESOURCE_EXHAUSTED": 1}
    assert s["error_details"] == {"UNAVAILABLE": first.detail, "RESOURCE_EXHAUSTED": full.detail}
    # and the gRPC target fills it from the client's error (a client whose stream fails as the
    # SDK's does when the router ends the call)
    import grpc
    from baton_client.errors import UnavailableError

    class Failing:
        def stream(self, **kw):
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "every attempt failed")

    target = lg.GrpcTarget.__new__(lg.GrpcTarget)
    target.client, target.timeout = Failing(), 1.0
    got = target(lg.Req([1, 2, 3], 4))
    assert (got.error, got.detail) == ("UNAVAILABLE", "UNAVAILABLE: every attempt failed")


def test_goodput_search_brackets_then_bisects():
    capacity = 3.3  # attainment falls off a cliff past this rate
    seen = []

    def attainment(rate):
        seen.append(rate)
        return 0.95 if rate <= capacity else 0.5

    goodput, points = lg.find_goodput(attainment, start=0.5, refine=4)
    assert seen[:4] == [0.5, 1.0, 2.0, 4.0]  # doubling until the first failure
    assert 2.0 <= goodput <= capacity < goodput + (4.0 - 2.0) / 2**4 + 1e-9
    assert [p[0] for p in points] == seen
    # a start that already fails halves down
    goodput, points = lg.find_goodput(attainment, start=16.0, refine=0)
    assert [p[0] for p in points] == [16.0, 8.0, 4.0, 2.0] and goodput == 2.0
    # nothing passes: halving stops at min_rate
    goodput, points = lg.find_goodput(lambda r: 0.0, start=1.0, min_rate=0.25)
    assert goodput == 0.0 and [p[0] for p in points] == [1.0, 0.5, 0.25]
    assert len(lg.find_goodput(lambda r: 0.0, start=1.0)[1]) == 7  # down to start / 64
    # everything passes: the cap
    assert lg.find_goodput(lambda r: 1.0, start=1.0, max_rate=8.0)[0] == 8.0
    # exactly at the target, as a mean over two draws rounds it (86% and 94%): a pass
    assert (0.86 + 0.94) / 2 < 0.9
    assert lg.find_goodput(lambda r: (0.86 + 0.94) / 2 if r <= 2 else 0.5, start=1.0,
                           refine=0)[0] == 2.0


def test_poisson_arrivals_have_the_rate():
    reqs = lg.synthetic(4000, (5, 5), (1, 1), lg.Tokens(10, 20, "x"))
    at = [r.at for r in lg.poisson(reqs, rate=4.0, seed=1)]
    assert at[0] == 0.0 and all(b >= a for a, b in zip(at, at[1:]))
    assert (len(at) - 1) / at[-1] == pytest.approx(4.0, rel=0.05)
    assert all(len(r.prompt) == 5 and all(10 <= t < 20 for t in r.prompt) for r in reqs)
    assert lg.synthetic(3, (5, 5), (1, 1), lg.Tokens(10, 20, "y"))[0].prompt != reqs[0].prompt


def test_shared_prefix_and_multi_turn_share_what_they_should():
    toks = lg.Tokens(10, 10**6, "t")
    sp = lg.shared_prefix(8, groups=2, prefix_len=20, suffix_len=(5, 5), output_len=(3, 3),
                          tokens=toks)
    assert sp[0].prompt[:20] == sp[2].prompt[:20] != sp[1].prompt[:20]
    assert sp[0].prompt[20:] != sp[2].prompt[20:]
    mt = lg.multi_turn(6, conversations=2, system_len=10, user_len=(4, 4), output_len=(3, 3),
                       tokens=toks)
    # turn 2 of conversation 0 extends turn 1 by its reply (3) and a user message (4)
    assert mt[2].prompt[:len(mt[0].prompt)] == mt[0].prompt
    assert len(mt[2].prompt) == len(mt[0].prompt) + 3 + 4
    assert mt[1].prompt[:10] != mt[0].prompt[:10]


def test_trace_workloads():
    toks = lg.Tokens(100, 1000, "s")
    az = lg.azure(DATA / "azure_llm_2023_conv-head50.csv", 50, toks, scale=0.5, max_input=300)
    # the file's first rows: 374, 396, 879 context tokens; 44, 109, 55 generated
    assert [len(r.prompt) for r in az[:3]] == [187, 198, 300]
    assert [r.max_tokens for r in az[:3]] == [22, 54, 28]
    assert az[0].at == 0.0 and az[1].at == pytest.approx(4.3145788, abs=1e-6)
    mc = lg.mooncake(DATA / "mooncake_synthetic_trace-head20.jsonl", 20, toks, block_tokens=16,
                     max_input=10**6)
    assert len(mc[0].prompt) == round(40160 * 16 / 512) and mc[0].max_tokens == 6
    assert mc[2].at == pytest.approx(0.040)
    assert not math.isnan(sum(r.at for r in mc))


def test_closed_loop_counts_successes_errors_and_short_outputs():
    import threading
    import time as _time

    from baton.bench.loadgen import ClosedLoop, Record, Req

    calls, lock = [], threading.Lock()

    def target(req):
        with lock:
            calls.append(req)
            n = len(calls)
        rec = Record(len(req.prompt), req.max_tokens, _time.monotonic(),
                     output_tokens=req.max_tokens - (n % 3 == 1))  # every third one short
        rec.error = "UNAVAILABLE" if n % 3 == 2 else None
        _time.sleep(0.002)
        return rec

    loop = ClosedLoop(target, lambda rng: Req([rng.randrange(100, 200)] * 4, 8))
    loop.set(2)
    while len(calls) < 30:
        _time.sleep(0.01)
    loop.set(0)
    n = len(calls)
    assert loop.ok + len(loop.errors) == n
    whats = [e[1] for e in loop.errors]
    assert whats.count("UNAVAILABLE") == (n + 1) // 3
    assert whats.count("short: 7 of 8 tokens") == (n + 2) // 3
    assert loop.ok == n // 3


def test_an_open_loop_request_waiting_for_a_client_counts_the_wait_in_its_times():
    # open loop sends from a bounded pool of clients; a request that arrives while every
    # client is busy is sent when one is free, and its TTFT still counts from its arrival
    import threading
    import time as _time

    from baton.bench.loadgen import Record, Req

    lock, started = threading.Lock(), []
    busy, release = threading.Event(), threading.Event()

    def target(req):
        rec = Record(len(req.prompt), req.max_tokens, _time.monotonic())
        with lock:
            started.append(req.max_tokens)
            if len(started) == 2:
                busy.set()
        if req.max_tokens < 2:  # the first two hold both clients until released
            assert release.wait(60)
        rec.first = rec.end = _time.monotonic()
        rec.chunk_times, rec.output_tokens = [rec.first], 1
        return rec

    reqs = [Req([1, 2, 3], i, at=0.0) for i in range(4)]
    out: list = []
    runner = threading.Thread(target=lambda: out.append(lg.run(target, reqs, clients=2)))
    runner.start()
    assert busy.wait(60)
    with lock:
        assert sorted(started) == [0, 1]  # no third client to send the others
    released_at = _time.monotonic()
    release.set()
    runner.join(60)
    records, _ = out[0]
    t0 = records[0].sent  # every request arrived at the run's start
    assert all(r.sent == t0 for r in records)
    for r in records[:2]:
        assert r.sent + r.late < released_at
    for r in records[2:]:  # sent only once a client was free, timed from the arrival
        assert r.sent + r.late >= released_at
        assert r.ttft >= released_at - t0 and r.ttft >= r.late > 0
    s = lg.summarize(records, 1.0, 10.0, 1.0)
    assert s["late_s"]["n"] == 4 and s["late_s"]["max"] == max(r.late for r in records)
    # closed loop has no arrival times: nothing is late
    records, _ = lg.run(lambda req: Record(3, req.max_tokens, _time.monotonic(),
                                           _time.monotonic()), reqs[2:], 1)
    assert [r.late for r in records] == [0.0, 0.0]


def test_an_interrupted_open_loop_raises_at_once_and_sends_nothing_more():
    # Ctrl-C (bench/shifting_load.py turns SIGTERM into it) while one request is in flight
    # and another waits for the one client: run raises without waiting for the one in flight
    # (its server stops next), and the waiting one is never sent
    import threading
    import time as _time

    from baton.bench.loadgen import Record, Req

    started, first, release = [], threading.Event(), threading.Event()

    def target(req):
        started.append(req.max_tokens)
        first.set()
        assert release.wait(60)
        rec = Record(len(req.prompt), req.max_tokens, _time.monotonic())
        rec.first = rec.end = _time.monotonic()
        return rec

    class CtrlC:  # the third arrival: Ctrl-C comes as the loop reads its time
        prompt, max_tokens = [1], 2

        @property
        def at(self):
            assert first.wait(60)
            raise KeyboardInterrupt

    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        lg.run(target, [Req([1, 2, 3], 0, at=0.0), Req([1, 2, 3], 1, at=0.0), CtrlC()],
               clients=1)
    assert not release.is_set()  # raised with the first request still in flight
    clients = [t for t in threading.enumerate() if t not in before]
    release.set()
    for t in clients:
        t.join(60)
        assert not t.is_alive()
    assert started == [0]  # the second never left


def test_each_rate_is_measured_over_its_draws_each_with_its_own_arrivals():
    # `baton bench --goodput --draws 2`: every rate the search tries runs twice, the same
    # requests with the Poisson arrivals of seeds --seed and --seed+1, and the search goes by
    # the attainment over both
    import argparse
    import threading
    import time as _time

    from baton.bench.cli import Progress, RunConfig, add_bench_args, measure

    ap = argparse.ArgumentParser()
    add_bench_args(ap)
    cfg = RunConfig.from_args(ap.parse_args(
        ["run", "grpc://unused", "--workload", "synthetic", "--requests", "6",
         "--input-len", "4:8", "--output-len", "2:2", "--seed", "5", "--goodput",
         "--start-rate", "400", "--max-rate", "400", "--min-rate", "200", "--refine", "0",
         "--ttft-slo", "1", "--tpot-slo", "1", "--draws", "2", "--quiet"]))
    seen, lock = [], threading.Lock()

    def target(req):
        with lock:
            seen.append(req)
            n = len(seen)
        t = _time.monotonic()
        return lg.Record(len(req.prompt), req.max_tokens, t, t + 0.001, t + 0.002,
                         [t + 0.001, t + 0.002], req.max_tokens,
                         "UNAVAILABLE" if n % 3 == 0 else None)  # a third fail: both rates do

    res = measure(target, cfg.workload, cfg.load, "t", Progress(True))
    assert res["goodput_rps"] == 0.0
    assert [rate for rate, _ in res["points"]] == [400, 200]
    runs = res["runs"]
    assert [r["label"] for r in runs] == ["400 req/s, draw 1/2", "400 req/s, draw 2/2",
                                          "200 req/s, draw 1/2", "200 req/s, draw 2/2"]
    for (_, att), pair in zip(res["points"], (runs[:2], runs[2:])):
        assert att == pytest.approx((pair[0]["attainment"] + pair[1]["attainment"]) / 2)
    # each draw its own arrivals: the seeds 5 and 6 at each rate
    by_run = [sorted(r.at for r in seen[i * 6:(i + 1) * 6]) for i in range(4)]
    for i, (rate, seed) in enumerate([(400, 5), (400, 6), (200, 5), (200, 6)]):
        assert by_run[i] == pytest.approx([r.at for r in lg.poisson(seen[:6], rate, seed)])
    assert by_run[0] != by_run[1]


def test_draws_must_be_at_least_one(capsys):
    """`baton bench`, `baton tune` and the validation refuse `--draws 0` by name, and take 1
    with the same other arguments (so the refusal is the draws', not a missing argument's)."""
    import argparse

    from baton.bench.cli import add_bench_args
    from baton.bench.tune_validation import parse_args
    from baton.control.tune import add_tune_args

    bench, tune = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_bench_args(bench)
    add_tune_args(tune)
    for parse, rest in ((bench.parse_args, ["run", "grpc://unused", "--rate", "1"]),
                        (tune.parse_args, ["--ttft-slo", "1", "--tpot-slo", "0.1"]),
                        (parse_args, [])):
        assert parse([*rest, "--draws", "1"]).draws == 1
        with pytest.raises(SystemExit):
            parse([*rest, "--draws", "0"])
        assert "--draws: 0: must be >= 1" in capsys.readouterr().err


def test_a_benchmarks_machine_says_which_pages_the_engine_ran_on(monkeypatch):
    """Every result JSON's ``machine`` (and a profile's) records ``$BATON_HUGE_PAGES``: an
    engine on huge pages started ~6.7x slower and decoded ~1.03x faster on the 2-vCPU VM
    (bench/huge_pages.py), so a figure measured under one is not one of the other."""
    from baton.bench.common import machine

    monkeypatch.setenv("BATON_HUGE_PAGES", "0")  # the tests run under it (tests/conftest.py)
    assert machine()["baton_huge_pages"] == "0"
    monkeypatch.delenv("BATON_HUGE_PAGES")
    assert machine()["baton_huge_pages"] == "1"  # the engine's default
