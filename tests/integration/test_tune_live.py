"""`baton tune --live ROUTER --apply` against a real cluster (redis, a prefill and a decode worker
on a tiny model, a router with its HTTP front): it reads the router's live workload and the
registered workers, simulates both layouts of two workers and switches roles to the predicted
best, then keeps still while the last switch is recent, or while the gain is under --min-gain.
The costs are a synthetic profile in which a KV hand-off takes 5 s, so colocated serving must
win on any workload: the test is about the loop acting on the live cluster, not about the
simulator's accuracy (bench/tune_validation.py measures that)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from baton.control.registry import WorkerRegistry
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.support.cluster import Cluster
from tests.support.profiles import make_profile

pytestmark = pytest.mark.slow


def command(url: str, router: str, profile, *extra: str) -> list[str]:
    return [sys.executable, "-m", "baton.cli.main", "tune", "--live", router, "--redis-url", url,
            "--profile", str(profile), "--ttft-slo", "1", "--tpot-slo", "0.5",
            "--min-requests", "5", "--switch-gap", "0.2", "--refine", "1", "--json", *extra]


def tune(url: str, router: str, profile, *extra: str) -> dict:
    out = subprocess.run(command(url, router, profile, *extra),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def niceness(pid: int) -> int:
    """A process's nice value, from /proc (the 19th field of its stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[16])


def looping(cmd: list[str], n: int, while_running=None) -> list[dict]:
    """The first ``n`` looks of a repeating tuner (``--every``); ``while_running(pid)`` is
    called while it still runs."""
    loop = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in loop.stdout], daemon=True).start()
    try:
        looks = [json.loads(lines.get(timeout=120)) for _ in range(n)]
        if while_running:
            while_running(loop.pid)
    finally:
        loop.kill()
        loop.wait()
    return looks


def serve(stub, n: int) -> list[str]:
    paths = []
    for i in range(n):
        r = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(max_tokens=6,
                                                                     ignore_eos=True))
        r.token_ids.ids.extend((i * 13 + 7 * k) % 390 + 5 for k in range(80))  # > 64: remote
        final = [m.final for m in stub.Generate(r, timeout=120) if m.HasField("final")][0]
        assert final.finish_reason == "length" and final.usage.completion_tokens == 6
        paths.append(final.path)
    return paths


def test_the_live_tuner_switches_to_the_predicted_best_then_keeps_still(tiny_llama, tmp_path):
    profile = tmp_path / "profile.json"
    # every hand-off 5 s: colocated must win (at the workers' block size: the tuner refuses
    # a profile of another)
    make_profile(handoff=(5.0, 0.0), block_size=4).save(profile)
    args = ["--model", str(tiny_llama[0]), "--block-size", "4", "--num-blocks", "256"]
    with Cluster(prefill=1, decode=1, worker_args=args,
                 routers=[["--http-port", "0", "--local-prefill-max-tokens", "64"]]) as c:
        stub = api_pb2_grpc.BatonStub(c.router.channel)
        assert set(serve(stub, 8)) == {"remote"}
        registry = WorkerRegistry.from_url(c.redis.url)
        # the workers register what a profile is checked against: their model's fingerprint,
        # their torch threads (the Cluster's --threads 1, a profile's) and their processor
        from baton.engine.config import processor

        records = registry.workers()
        assert {w.threads for w in records} == {1} and len({w.fingerprint for w in records}) == 1
        assert {w.processor for w in records} == {processor("cpu")} != {""}
        # a profile of another model is refused naming both (a single look exits 1)
        other = tmp_path / "other.json"
        replace(make_profile(block_size=4), fingerprint="0" * 32, model_name="another").save(other)
        out = subprocess.run(command(c.redis.url, c.router.http_address, other),
                             capture_output=True, text=True, timeout=300)
        refused = json.loads(out.stdout.strip().splitlines()[-1])
        assert out.returncode == 1 and refused["reason"].startswith(
            "error: switches nothing: the profile was measured on the model another "
            f"(fingerprint 0000000000000000), the workers serve {records[0].model}")
        # and one of another thread count, naming both ways out
        two = tmp_path / "two.json"
        replace(make_profile(block_size=4), threads=2).save(two)
        out = subprocess.run(command(c.redis.url, c.router.http_address, two),
                             capture_output=True, text=True, timeout=300)
        refused = json.loads(out.stdout.strip().splitlines()[-1])
        assert out.returncode == 1 and refused["reason"] == (
            "error: switches nothing: the profile was measured at 2 torch thread(s) a worker, "
            "the workers run 1: start them with --threads 2 (`baton up --threads 2`), or "
            "measure theirs (`baton profile --threads 1`)")

        # too little traffic in the router's window to decide on: nothing switches
        few = tune(c.redis.url, c.router.http_address, profile, "--apply",
                   "--min-requests", "100")
        assert few["action"] == "none" and few["requests"] == 8 and few["filling"]
        # repeating every 10 minutes, it looks again on the short --fill-every pause while
        # the window is under --min-requests: the second look is the event waited on
        def nice_below_the_workers(pid: int) -> None:
            # the loop runs below the workers' priority (--nice, default 10), theirs unchanged
            assert niceness(pid) == niceness(os.getpid()) + 10
            assert {niceness(w.proc.pid) for w in c.workers()} == {niceness(os.getpid())}

        # a second look only after --every would come 600 s on: the wait gives up at 120
        looks = looping(command(c.redis.url, c.router.http_address, profile,
                                "--min-requests", "100", "--every", "600",
                                "--fill-every", "0.1"), 2, nice_below_the_workers)
        assert [(x["action"], x["requests"], x["filling"]) for x in looks] == \
            [("none", 8, True)] * 2
        # repeating, a switch needs --confirm looks in a row that want it: the first two of
        # three only count; the third would switch (no --apply here: it says so, nothing moves).
        # The window's 8 requests, one after another, are too few to call it steady (4 in
        # each third: tests/unit/test_tune_live.py), which would let one look switch
        looks = looping(command(c.redis.url, c.router.http_address, profile, "--every", "0.1",
                                "--confirm", "3"), 3)
        assert [x["recommended"] for x in looks] == ["2 colocated"] * 3
        assert {x["steady"] for x in looks} == {""}
        assert "look 1 of 3 in a row" in looks[0]["reason"]
        assert "look 2 of 3 in a row" in looks[1]["reason"]
        assert looks[2]["reason"].startswith("switch to 2 colocated")
        assert {x["action"] for x in looks} == {"none"}
        # no --apply: a look, calibrated by default
        look = tune(c.redis.url, c.router.http_address, profile)
        assert look["action"] == "none" and look["current"] == "1P+1D"
        assert look["recommended"] == "2 colocated" and look["requests"] == 8
        # the synthetic profile records no model: the look says it could not check it
        assert "records no model fingerprint" in look["profile_unchecked"]
        # eight requests are too few to calibrate the profile's factors on: it says so
        assert not look["calibration"]["applied"]
        assert any("fewer than 10" in n for n in look["calibration"]["notes"])
        plain = tune(c.redis.url, c.router.http_address, profile, "--no-calibrate")
        assert plain["recommended"] == "2 colocated"
        assert plain["calibration"]["notes"] == ["off (--no-calibrate)"]
        assert sorted(w.role for w in registry.workers()) == ["decode", "prefill"]

        went = tune(c.redis.url, c.router.http_address, profile, "--apply")
        assert went["action"] == "switched", went["reason"]
        assert [(s[1], s[2]) for s in went["switches"]] == [("prefill", "decode")]
        assert sorted(w.role for w in registry.workers()) == ["decode", "decode"]
        Cluster.wait_router_sees(c.router, decode=2, prefill=0)
        assert set(serve(stub, 4)) == {"local"}  # and it serves on, now colocated

        again = tune(c.redis.url, c.router.http_address, profile, "--apply")
        assert again["action"] == "none" and again["reason"].startswith("stay")
        # beside the simulated attainment, the window's own: its 12 requests against the SLOs
        with urllib.request.urlopen(f"http://{c.router.http_address}/v1/baton/workload") as r:
            rows = [json.loads(x) for x in r.read().decode().splitlines() if x.strip()]
        assert len(rows) == again["requests"] == 12
        met = sum(x["ttft_s"] <= 1 and x["tpot_s"] <= 0.5 for x in rows)
        assert again["attainment_measured"] == met / 12
        # a different best within --min-dwell of the last switch: it waits
        make_profile(block_size=4).save(profile)  # hand-offs cheap again: the split may win
        soon = tune(c.redis.url, c.router.http_address, profile, "--apply",
                    "--min-gain", "0")
        assert soon["action"] == "none"
        assert "too recent" in soon["reason"] or soon["reason"].startswith("stay")
        # the window records the sampler's filters each request put to work: an OpenAI
        # client's default temperature (1) with top_p, and one at temperature 0; a look whose
        # profile timed no sampling names the requests it simulates at greedy's cost
        base = f"http://{c.router.http_address}/v1"
        with urllib.request.urlopen(f"{base}/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
        for extra in ({"top_p": 0.9}, {"temperature": 0}):
            body = json.dumps({"model": model, "prompt": "Once upon", "max_tokens": 4,
                               "ignore_eos": True, **extra}).encode()
            req = urllib.request.Request(f"{base}/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert json.loads(r.read())["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(f"{base}/baton/workload") as r:
            rows = [json.loads(x) for x in r.read().decode().splitlines() if x.strip()]
        assert [x["sampling"] for x in rows[-2:]] == [["temperature", "top_p"], []]
        assert {tuple(x["sampling"]) for x in rows[:-2]} == {()}  # gRPC's default: greedy
        noted = tune(c.redis.url, c.router.http_address, profile)
        assert noted["sampling_unmeasured"].startswith(
            "1 of the window's 14 requests sample with temperature, top_p, which the profile "
            "has no cost for")
        c.assert_quiet()
