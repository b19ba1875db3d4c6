"""The router's live workload (services/router/workload_log.py): lengths, counts and phase times
per finished request, the prefix structure as block numbers (no token ids, no hashes), bounded
in records and time, read back by `baton tune` (control/workload.baton_trace) as a trace whose
prompts share exactly the prefixes the originals shared."""

from __future__ import annotations

import json

from baton.control.tune import TraceSlice, load_trace
from baton.control.workload import Tokens, baton_trace
from baton.engine.block_hash import hash_chain
from baton.services.router.workload_log import WorkloadLog
from baton_client.v1 import api_pb2


def final(prompt: int, out: int, ttft: float = 0.5, decode_wait: float = 0.0):
    return api_pb2.GenerateFinal(
        finish_reason="length", path="remote", index_cached_tokens=16,
        usage=api_pb2.Usage(prompt_tokens=prompt, completion_tokens=out, cached_tokens=16),
        timing=api_pb2.Timing(first_token_s=ttft, decode_s=0.01 * (out - 1), prefill_s=0.2,
                              queue_s=0.05, transfer_s=0.01, route_s=0.001,
                              decode_wait_s=decode_wait))


class Clock:
    t = 1_800_000_000.0

    def __call__(self):
        return self.t


def test_records_hold_lengths_and_times_and_shared_prefixes_only():
    clock = Clock()
    log = WorkloadLog(window_s=60, clock=clock)
    system = list(range(1000, 1064))  # 4 blocks of 16 shared by both prompts
    a, b = system + list(range(5000, 5040)), system + list(range(7000, 7033))
    for ids, out in ((a, 7), (b, 3)):
        log.record(final(len(ids), out, decode_wait=0.3), clock(), hash_chain(ids[:-1], 16,
                                                                              b"ns"), 16)
    ra, rb = log.export()
    assert (ra["prompt_tokens"], ra["output_tokens"], rb["prompt_tokens"]) == (104, 7, 97)
    assert ra["blocks"][:4] == rb["blocks"][:4] and set(ra["blocks"][4:]).isdisjoint(rb["blocks"])
    assert ra["blocks"] == list(range(6))  # small numbers in first-seen order
    assert ra["phases"]["decode_wait"] == 0.3 and ra["phases"]["prefill"] == 0.15
    assert ra["tpot_s"] == 0.01 and ra["index_cached_tokens"] == 16
    text = json.dumps(log.export())
    assert "5000" not in text and "1000" not in text  # no token ids left the router


def test_memory_is_bounded_in_records_time_and_block_numbers():
    clock = Clock()
    log = WorkloadLog(window_s=100, max_records=5, max_blocks=8, clock=clock)
    for i in range(7):
        clock.t += 10
        log.record(final(40, 2), clock(), hash_chain(list(range(i * 100, i * 100 + 33)), 16,
                                                     b"ns"), 16)
    assert len(log) == 5  # the oldest two went
    clock.t += 85  # the window (100 s) now holds the last two
    assert [r["at"] for r in log.export()] == [clock.t - 95, clock.t - 85]
    assert len(log._numbers) <= 8


def test_tune_reads_the_export_as_a_trace(tmp_path):
    clock = Clock()
    log = WorkloadLog(clock=clock)
    shared = list(range(300, 332))
    prompts = [shared + [1, 2, 3, 4, 5], list(range(900, 950)), shared + [9] * 20]
    for i, ids in enumerate(prompts):
        clock.t = 1_800_000_000.0 + 2.0 * i
        log.record(final(len(ids), 5 + i), clock() - 0.5, hash_chain(ids[:-1], 16, b"n"), 16)
    path = tmp_path / "workload.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in log.export()))
    reqs = baton_trace(path, 10, Tokens(100, 10000, "t"))
    assert [len(r.prompt) for r in reqs] == [37, 50, 52]
    assert [r.max_tokens for r in reqs] == [5, 6, 7] and [r.at for r in reqs] == [0, 2, 4]
    assert reqs[0].prompt[:32] == reqs[2].prompt[:32] != reqs[1].prompt[:32]
    auto = load_trace(TraceSlice(str(path), "auto", 10, 0, 1.0, 2048, 512))
    assert [len(r.prompt) for r in auto] == [37, 50, 52]  # sniffed as a Baton workload


def test_running_requests_are_in_the_window_with_their_output_estimated():
    """Under overload most of the window's arrivals have not finished: the export holds them
    (the tuner would see an idle cluster otherwise), by arrival, their output length the
    finished ones' mean capped by their max_tokens; a request that arrived before the window
    and finishes now is not in it; a cancelled one leaves no record."""
    clock = Clock()
    log = WorkloadLog(window_s=60, clock=clock)
    t0 = clock.t
    log.arrive("old", t0, 500, 64, None, 16)
    clock.t += 30
    for i, (rid, max_tokens) in enumerate((("a", 100), ("b", 8), ("c", 1000), ("gone", 9))):
        log.arrive(rid, clock() + i, 40 + i, max_tokens, None, 16)
    rows = log.export()
    assert [r["prompt_tokens"] for r in rows] == [500, 40, 41, 42, 43]
    assert all(r["in_flight"] for r in rows)
    assert [r["output_tokens"] for r in rows] == [64, 100, 8, 1000, 9]  # none finished yet
    clock.t += 40  # "old" arrived 70 s ago: out of the window, finished or not
    log.record(final(500, 64), t0, None, 16, "old")
    log.record(final(40, 20), t0 + 30, None, 16, "a")
    log.forget("gone")
    rows = log.export()
    assert [(r["prompt_tokens"], r["output_tokens"], r.get("in_flight", False)) for r in rows] \
        == [(40, 20, False), (41, 8, True), (42, 20, True)]  # mean 20, b's cap 8
    assert rows[1]["max_tokens"] == 8 and "ttft_s" not in rows[1]
    clock.t += 45  # the running ones arrived more than 60 s ago now
    assert log.export() == [] and len(log._open) == 0


def test_the_window_records_the_samplers_filters_each_request_asked_for(tmp_path):
    """A sampled token costs a step more than a greedy one, by filter: the window records the
    filters each request's parameters put to work (none for greedy, whatever else it sets),
    running or finished, and `baton tune` reads them back with the trace; `--sampling`
    overrides them, and names what it does not know."""
    import argparse

    import pytest
    from baton.control.profile import SAMPLING
    from baton.control.workload import sampling_arg, sampling_params
    from baton.services.router.workload_log import sampling_filters

    P = api_pb2.SamplingParams
    assert sampling_filters(P()) == []  # gRPC's default: greedy
    assert sampling_filters(P(temperature=0.0, top_p=0.5, top_k=5)) == []  # an argmax
    assert sampling_filters(P(temperature=0.7)) == ["temperature"]
    assert sampling_filters(P(temperature=1.0, top_p=1.0)) == ["temperature"]  # cuts nothing
    assert sampling_filters(P(temperature=1.0, top_k=40, min_p=0.1, top_p=0.9)) == list(SAMPLING)
    clock = Clock()
    log = WorkloadLog(clock=clock)
    log.arrive("g", clock(), 40, 8, None, 16, [])
    log.arrive("s", clock() + 1, 41, 8, None, 16, ["temperature", "top_p"])
    log.arrive("r", clock() + 2, 42, 8, None, 16, ["temperature"])
    clock.t += 5
    log.record(final(40, 8), clock() - 5, rid="g")
    log.record(final(41, 8), clock() - 4, rid="s")
    rows = log.export()
    assert [r["sampling"] for r in rows] == [[], ["temperature", "top_p"], ["temperature"]]
    assert rows[2]["in_flight"]
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = load_trace(TraceSlice(str(path), "baton", 10, 0, 1.0, 2048, 512))
    assert [r.sampling for r in reqs] == [(), ("temperature", "top_p"), ("temperature",)]
    every = load_trace(TraceSlice(str(path), "baton", 10, 0, 1.0, 2048, 512, ("temperature",
                                                                               "min_p")))
    assert {r.sampling for r in every} == {("temperature", "min_p")}
    # --sampling: temperature comes with any filter, in the profile's order; greedy is none
    assert sampling_arg("top_p") == ("temperature", "top_p")
    assert sampling_arg("top_p,top_k") == ("temperature", "top_k", "top_p")
    assert sampling_arg("greedy") == ()
    with pytest.raises(argparse.ArgumentTypeError, match="nucleus: not a sampler filter"):
        sampling_arg("top_p,nucleus")
    # and a load generator sends what `baton profile` timed for them
    assert sampling_params(()) == {"temperature": 0.0}
    assert sampling_params(("temperature", "top_p")) == {"temperature": 1.0, "top_p": 0.95}
