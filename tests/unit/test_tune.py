"""The cost model's fits, the cluster simulation on hand-computable cases, and `baton tune`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from baton.control.calibrate import checked
from baton.control.profile import (
    BUSY_OUTPUT,
    DECODE_ROUNDS,
    LONE_GAPS,
    LONE_PROMPTS,
    LONE_STREAMS,
    PREFILL_PROMPT,
    PREFILL_ROUNDS,
    PREFILL_STREAMS,
    PREFILL_TOKENS,
    SAMPLING,
    SAMPLING_BATCH,
    SATURATED_PROMPTS,
    SERVED_MANY,
    SERVED_TOKENS,
    CostModel,
    Profile,
    ProfileError,
    prefill_factors,
    prefill_latency_factor,
    prefill_latency_factors,
    prefill_throughput_factor,
)
from baton.control.sim import Knobs, Layout, attainment, block_keys, simulate

from tests.support.processes import alive, descendants
from tests.support.profiles import make_profile, tok

DATA = Path(__file__).resolve().parent.parent / "data"


# ---- the cost model ------------------------------------------------------------------------------


def test_cost_model_recovers_the_coefficients_it_was_measured_with():
    cm = CostModel(make_profile(per_seq=0.002, attn_decode=1e-5, attn_prefill=3e-7,
                                handoff=(0.005, 2e-9)))
    assert cm.per_seq == pytest.approx(0.002, rel=1e-6)
    assert cm.attn_decode == pytest.approx(1e-5, rel=1e-6)
    assert cm.attn_prefill == pytest.approx(3e-7, rel=1e-6)
    assert cm.handoff_fixed == pytest.approx(0.005, rel=1e-6)
    assert cm.handoff(500) == pytest.approx(0.005 + 2e-9 * 500 * 1000, rel=1e-6)
    # a mixed step: a 100-token chunk after 50 computed tokens, two decodes at 40 and 60
    want = tok(102) + 3e-7 * 100 * (50 + 101 / 2) + 0.002 * 2 + 1e-5 * 100
    assert cm.step([(100, 50)], [40, 60]) == pytest.approx(want, rel=1e-6)


def test_decode_steps_below_the_prefill_tables_are_fitted_with_an_offset():
    """A decode grid whose steps cost less than the batched prefill table's per-token work (a
    table that ran slow, or prompt steps' own fixed cost): a version-11 model reproduces the
    grid with an offset for steps of decodes alone and leaves prompt steps as the table says;
    a version-10 profile reads as fitted without one."""
    p = make_profile(per_seq=0.002, attn_decode=1e-5)
    p.decode = [{**r, "s": r["s"] - 0.004} for r in p.decode]
    cm = CostModel(p)
    assert (cm.decode_offset, cm.per_seq, cm.attn_decode) == pytest.approx(
        (-0.004, 0.002, 1e-5), rel=1e-6)
    for r in p.decode:
        assert cm.step([], [r["context"]] * r["batch"]) == pytest.approx(r["s"], rel=1e-6)
    # a step with a prompt chunk runs the table's path: no offset
    assert cm.step([(100, 0)], [40]) == pytest.approx(
        tok(101) + 0.002 + 1e-5 * 40, rel=1e-6)
    old = CostModel(dataclasses.replace(p, version=10))
    assert old.decode_offset == 0.0
    assert old.step([], [64]) > p.decode[0]["s"] * 1.05  # the grid's batch-1 step over-costed


def test_no_decode_offset_where_it_leaves_any_batch_a_step_at_or_under_zero():
    """`tok` interpolates the prefill table, which on a noisy machine (the tiny model's CI
    profile) need not rise with the batch: an offset that fits the grid but leaves a batch the
    grid did not measure at or under 0 is dropped (a served row's model step of 0 divided the
    serving factor by zero), even where batch 1's step stays positive."""
    p = make_profile()
    dip = {1: 0.011, 16: 0.001, 256: tok(256), 1024: tok(1024)}  # 16 tokens under 1
    p.prefill = [{"tokens": n, "requests": 1, "s": s} for n, s in dip.items()]
    kept = CostModel(p)
    p.decode = [{"batch": b, "context": c, "s": kept.tok(b) - 0.0105}
                for b, c in ((1, 64), (1, 512), (32, 64), (32, 256))]
    assert min(r["s"] for r in p.decode) > 0
    cm = CostModel(p)
    assert cm.decode_offset == 0.0
    assert all(cm.step([], [64] * b) > 0 for b in range(1, p.max_num_seqs + 1))
    # the same grid over a table that rises with the batch keeps its offset
    q = make_profile()
    rising = CostModel(q)
    q.decode = [{**r, "s": rising.tok(r["batch"]) - 0.0105} for r in p.decode]
    assert CostModel(q).decode_offset == pytest.approx(-0.0105)


def test_long_prompts_past_the_token_budget_are_fitted_as_their_chunks():
    # a 2048-token prompt under a 1024-token budget runs as two steps: 1024 tokens, then 1024
    # more attending to the first 1024 as well
    a = 3e-7
    p = make_profile(attn_prefill=a)
    p.prefill_long = [{"tokens": 512, "s": tok(512) + a * 512 * 513 / 2},
                      {"tokens": 2048, "s": 2 * tok(1024) + a * (1024 * 1025 / 2
                                                                 + 1024 * (1024 + 1025 / 2))}]
    cm = CostModel(p)
    assert cm.attn_prefill == pytest.approx(a, rel=1e-6)
    assert cm.step([(1024, 0)], []) + cm.step([(1024, 1024)], []) == pytest.approx(
        p.prefill_long[1]["s"], rel=1e-6)


def test_the_serving_factors_scale_steps_by_their_tokens_but_not_the_hand_off():
    p = make_profile(per_seq=0.002, attn_decode=1e-5, attn_prefill=3e-7)
    bare = CostModel(p)
    p.serving_factor, p.prefill_factor = 1.1, 1.3
    served = CostModel(p)
    assert served.step([], [500] * 8) == pytest.approx(1.1 * bare.step([], [500] * 8))
    assert served.step([(1024, 0)], []) == pytest.approx(1.3 * bare.step([(1024, 0)], []))
    # a mixed step: 100 prompt tokens and 2 decodes weigh the factors 100:2
    mixed = ([(100, 50)], [40, 60])
    assert served.step(*mixed) == pytest.approx((100 * 1.3 + 2 * 1.1) / 102 * bare.step(*mixed))
    assert served.handoff(1000) == bare.handoff(1000)
    assert served.step([], []) == 0.0


def test_engine_prompt_is_a_lone_prompt_chunked_under_the_token_budget():
    cm = CostModel(make_profile(batched=1024, attn_prefill=3e-7))
    assert cm.engine_prompt(512) == pytest.approx(cm.engine_step(512, 512 * 513 / 2, []))
    first, second = 1024 * 1025 / 2, 1024 * (1024 + 1025 / 2)  # the second sees the first too
    assert cm.engine_prompt(2048) == pytest.approx(
        cm.engine_step(1024, first, []) + cm.engine_step(1024, second, []))


def test_tok_interpolates_and_extends_linearly():
    cm = CostModel(make_profile())
    assert cm.tok(600) == pytest.approx(tok(600))
    assert cm.tok(2048) == pytest.approx(tok(2048))  # past the last point
    assert cm.tok(0) == 0.0


def test_profile_round_trip_and_version_check(tmp_path):
    p = make_profile()
    path = p.save(tmp_path / "p.json")
    assert Profile.load(path) == p
    d = json.loads(path.read_text())
    d["version"] = 99
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="version 99"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")


# ---- the simulation, by hand ---------------------------------------------------------------------


def test_one_request_colocated():
    (r,) = simulate(Layout(0, 1, colocated=True), make_profile(), [(100, 5, 0.0)])
    assert r.path == "local"
    assert r.ttft == pytest.approx(0.004 + tok(100))  # router, then one prefill step
    assert r.tpot == pytest.approx(tok(1))  # then one decode step per token
    assert r.end == pytest.approx(0.004 + tok(100) + 4 * tok(1))


def test_a_sampled_token_costs_its_step_what_the_profile_measured_for_its_filters():
    """Each row that ends a step with a token it samples with filters adds what the profile
    timed for them (the serving factor over it, as over the rest of the step), the first
    token's prefill step included; greedy rows and a profile that timed nothing add nothing."""
    import dataclasses

    p = dataclasses.replace(make_profile(), serving_factor=1.5, prefill_factor=1.5,
                            sampling={"temperature": 0.002, "top_k": 0.001, "top_p": 0.01})
    greedy, top_p, both = simulate(Layout(0, 3, colocated=True), p, [
        (100, 5, 0.0, (), ()), (100, 5, 100.0, (), ("temperature", "top_p")),
        (100, 5, 200.0, (), ("temperature", "top_k", "top_p"))])
    assert top_p.tpot == pytest.approx(greedy.tpot + 1.5 * 0.012)
    assert top_p.ttft == pytest.approx(greedy.ttft + 1.5 * 0.012)
    assert both.tpot == pytest.approx(greedy.tpot + 1.5 * 0.013)
    assert greedy.tpot == pytest.approx(1.5 * tok(1))
    # a filter the profile did not time, and a profile from before sampling was timed: greedy's
    (minp,) = simulate(Layout(0, 1, colocated=True), p, [(100, 5, 0.0, (), ("min_p",))])
    (old,) = simulate(Layout(0, 1, colocated=True), dataclasses.replace(p, sampling={}),
                      [(100, 5, 0.0, (), ("temperature", "top_p"))])
    assert minp.tpot == pytest.approx(greedy.tpot) and old.tpot == pytest.approx(greedy.tpot)


def test_one_request_disaggregated():
    p = make_profile()
    (r,) = simulate(Layout(1, 1), p, [(300, 3, 0.0)])
    handoff = 0.002 + 1e-9 * 300 * 1000
    assert r.path == "remote"
    assert r.ttft == pytest.approx(0.004 + tok(300) + Knobs().rpc_s + handoff)
    assert r.tpot == pytest.approx(tok(1))


def test_short_prompts_stay_on_the_decode_worker():
    (short, long_) = simulate(Layout(1, 1), make_profile(), [(64, 2, 0.0), (65, 2, 10.0)])
    assert (short.path, long_.path) == ("local", "remote")


def test_a_saturated_prefill_worker_sends_only_short_prompts_to_the_decode_worker():
    # the first prompt makes the prefill worker saturated (1 in flight); while it prefills, a
    # 200-token prompt is prefilled locally and a 900-token one waits for the prefill worker
    burst = [(1000, 2, 0.0), (200, 2, 0.001), (900, 2, 0.002)]
    first, short, long_ = simulate(Layout(1, 1), make_profile(), burst,
                                   Knobs(prefill_saturation=1, saturated_local_max_tokens=256))
    assert (first.path, short.path, long_.path) == ("remote", "local", "remote")
    assert long_.ttft > first.ttft  # it waited for the first prompt's prefill
    anything = simulate(Layout(1, 1), make_profile(), burst,
                        Knobs(prefill_saturation=1, saturated_local_max_tokens=-1))
    assert [r.path for r in anything] == ["remote", "local", "local"]


def test_the_simulated_router_sends_a_short_prompt_past_a_long_prefill():
    """As the router's ``prefill`` scorer does (tests/unit/test_routing_policy.py): of two
    colocated workers, one prefilling a 3,000-token prompt with one request in flight and one
    decoding two, the short prompt that comes next goes to the decoding one and has its first
    token in tens of milliseconds; scored by request count alone it waits behind the three
    1,024-token chunks of that prompt."""
    from baton.control.pd import DEFAULT_SCORER_WEIGHTS

    # (prompt, output, arrival): two long answers on one worker (the second one's short
    # answer, on the other, ends), then the long prompt goes to the other, then the short one
    shape = [(16, 400, 0.0), (16, 1, 0.001), (16, 400, 0.002), (3000, 4, 1.0), (32, 4, 1.1)]
    no_prefill = Knobs(weights=tuple((k, w) for k, w in DEFAULT_SCORER_WEIGHTS.items()
                                     if k != "prefill"))
    ttft = {}
    for name, knobs in (("prefill scorer", Knobs()), ("request count", no_prefill)):
        done = simulate(Layout(0, 2, True), make_profile(), shape, knobs)
        assert all(r.error is None for r in done)
        ttft[name] = done[4].first - done[4].sent
    assert ttft["prefill scorer"] < 0.1
    assert ttft["request count"] > 2.0


def test_a_saturated_queue_serves_in_arrival_order():
    """Budget 100 tokens a step: 5 prompts of 100 tokens arriving together prefill one a step;
    the k-th one's first token comes after k + 1 steps, each also carrying the decodes of those
    before it that are still running (output 1 here: none are)."""
    done = simulate(Layout(0, 1, colocated=True), make_profile(batched=100),
                    [(100, 1, 0.0)] * 5)
    for k, r in enumerate(done):
        assert r.ttft == pytest.approx(0.004 + (k + 1) * tok(100))
        assert r.end == r.first
    assert attainment(done, 0.004 + 3 * tok(100) + 1e-9, 1.0) == pytest.approx(3 / 5)


def test_decodes_batch_with_a_new_prefill():
    """A second request's prompt joins the first one's decode step (mixed batch)."""
    a, b = simulate(Layout(0, 1, colocated=True), make_profile(), [(50, 3, 0.0), (50, 2, 0.065)])
    t_a = 0.004 + tok(50)  # a's first token
    assert a.first == pytest.approx(t_a)
    # b arrives during a's first decode step [t_a, t_a + tok(1)]; it joins the next one
    assert b.first == pytest.approx(t_a + tok(1) + tok(51))
    assert a.end == pytest.approx(t_a + tok(1) + tok(51))


def test_the_kv_pool_bounds_admission():
    """Four blocks of 16 tokens: a 50-token prompt (4 blocks) runs alone; the second waits for
    the first to finish and free them."""
    a, b = simulate(Layout(0, 1, colocated=True), make_profile(blocks=4),
                    [(50, 2, 0.0), (50, 2, 0.0)])
    assert b.first == pytest.approx(a.end + tok(50))


def test_more_workers_serve_more():
    p = make_profile(per_seq=0.002, attn_decode=1e-5)
    shape = [(200, 20, i * 0.25) for i in range(60)]  # 4/s; one worker's prefill alone: 0.84 s/s
    one = attainment(simulate(Layout(0, 1, True), p, shape), 1.0, 0.2)
    two = attainment(simulate(Layout(0, 2, True), p, shape), 1.0, 0.2)
    assert one < 0.5 and two == 1.0


def test_step_noise_keeps_the_mean_step_and_lengthens_the_queues_near_capacity():
    """CostModel.step_noise S: every simulated step's time is the model's times a lognormal
    draw of mean 1 (S the sd of its log), the same draws each run; at 0 the simulation is the
    deterministic one. Lone requests keep their mean TTFT; near the worker's capacity the
    spread lengthens the queue (a queue's wait grows with its service times' variance), so
    fewer requests meet a TTFT SLO the deterministic run meets."""
    from baton.control.profile import CostModel

    p = make_profile()
    noisy = CostModel(p)
    noisy.step_noise = 0.3
    lone = [(100, 1, i * 10.0) for i in range(400)]  # never two at once
    plain = simulate(Layout(0, 1, True), p, lone)
    drawn = simulate(Layout(0, 1, True), p, lone, cost=noisy)
    assert max(r.ttft for r in plain) - min(r.ttft for r in plain) < 1e-9
    assert len({round(r.ttft, 9) for r in drawn}) > 100
    assert statistics.fmean(r.ttft for r in drawn) == pytest.approx(plain[0].ttft, rel=0.05)
    assert [r.ttft for r in simulate(Layout(0, 1, True), p, lone, cost=noisy)] == \
        [r.ttft for r in drawn]  # the same draws: a goodput search stays reproducible
    assert CostModel(p).step_noise == 0.0  # the default: every step as the model says
    busy = [(100, 1, i * tok(100) / 0.9) for i in range(400)]  # 90% of its prefill capacity
    slo = 0.004 + 2 * tok(100)  # twice a lone prompt's step
    assert attainment(simulate(Layout(0, 1, True), p, busy), slo, 1.0) == 1.0
    assert attainment(simulate(Layout(0, 1, True), p, busy, cost=noisy), slo, 1.0) < 0.95
    # (the draw alone passes 2x in 0.7% of steps at 0.3: the rest is the queue)


# ---- baton tune ----------------------------------------------------------------------------------


def test_baton_tune_prints_a_table_a_recommendation_and_writes_json_and_png(tmp_path):
    prof = make_profile(per_seq=0.002, attn_decode=1e-5).save(tmp_path / "p.json")
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "tune", "--trace",
         str(DATA / "azure_llm_2023_conv-head50.csv"), "--ttft-slo", "2", "--tpot-slo", "0.05",
         "--workers", "3", "--profile", str(prof), "--requests", "40", "--scale", "0.25",
         "--out", str(tmp_path / "t")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "recommendation:" in out.stdout
    for name in ("1P+2D", "2P+1D", "3 colocated"):
        assert name in out.stdout
    res = json.loads((tmp_path / "t.json").read_text())
    rows = {r["layout"]: r for r in res["configurations"]}
    assert set(rows) == {"1P+2D", "2P+1D", "3 colocated"}
    for r in rows.values():  # the goodput is a rate the search found passing
        assert r["goodput_rps"] > 0
        passing = [rate for rate, att in r["points"] if att >= 0.9]
        assert max(passing) == pytest.approx(r["goodput_rps"])
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_baton_profile_refit_fits_an_older_profile_again_from_its_rows(tmp_path, capsys):
    """`baton profile --refit P --out NEW` measures nothing: P's decode grid fitted with this
    version's offset and its serving factors over that model (its served rows at 1.2x the
    model's step come out 1.2); it needs --out and refuses a profile a serving check scaled or
    one without serving measurements."""
    import argparse

    from baton.bench.profile import add_profile_args, cmd_profile
    from baton.control.profile import VERSION

    ap = argparse.ArgumentParser()
    add_profile_args(ap)
    p = make_profile(per_seq=0.002, attn_decode=1e-5)
    p.decode = [{**r, "s": r["s"] - 0.004} for r in p.decode]
    mid = sum(SERVED_TOKENS) // 2
    now = CostModel(p)  # this version's model of the grid
    p.served = [{"batch": b, "context": c, "s": 1.2 * now.step([], [c + mid] * b)}
                for b, c in ((16, 128), (8, 384), (4, 768))]
    old = dataclasses.replace(p, version=10, serving_factor=1.0)
    src = old.save(tmp_path / "v10.json")
    assert cmd_profile(ap.parse_args(["--refit", str(src), "--out", str(tmp_path / "v.json"),
                                      "--device", "cpu"])) == 0
    assert "decode_offset_s: 0 -> -0.004" in capsys.readouterr().out
    q = Profile.load(tmp_path / "v.json")
    assert q.version == VERSION and q.serving_factor == pytest.approx(1.2)
    assert CostModel(q).decode_offset == pytest.approx(-0.004)
    assert (q.decode, q.served_prefill, q.measured_at) == (p.decode, p.served_prefill,
                                                           p.measured_at)
    # no --out; a checked profile; one measured without workers
    assert cmd_profile(ap.parse_args(["--refit", str(src), "--device", "cpu"])) == 2
    assert "pass --out" in capsys.readouterr().err
    assert cmd_profile(ap.parse_args(["--refit", str(src), "--check", str(src), "--out",
                                      str(tmp_path / "x.json"), "--device", "cpu"])) == 2
    assert "one or the other" in capsys.readouterr().err
    scaled = dataclasses.replace(old, checked=[{"decode_ratio": 1.1}]).save(tmp_path / "c.json")
    assert cmd_profile(ap.parse_args(["--refit", str(scaled), "--out", str(tmp_path / "x.json"),
                                      "--device", "cpu"])) == 2
    assert "scaled by a serving check" in capsys.readouterr().err
    bare = dataclasses.replace(old, served=[]).save(tmp_path / "bare.json")
    assert cmd_profile(ap.parse_args(["--refit", str(bare), "--out", str(tmp_path / "x.json"),
                                      "--device", "cpu"])) == 2
    assert "no serving measurements" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_baton_profile_check_refuses_another_device_and_a_missing_file(tmp_path, capsys):
    """`baton profile --check` times nothing on a device the profile was not measured on, and
    names an unreadable profile."""
    import argparse

    from baton.bench.profile import add_profile_args, cmd_profile

    ap = argparse.ArgumentParser()
    add_profile_args(ap)
    gpu = dataclasses.replace(make_profile(), device="cuda").save(tmp_path / "gpu.json")
    assert cmd_profile(ap.parse_args(["--check", str(gpu), "--device", "cpu"])) == 2
    assert "measured on cuda" in capsys.readouterr().err
    assert cmd_profile(ap.parse_args(["--check", str(tmp_path / "none.json"),
                                      "--device", "cpu"])) == 2
    assert "none.json" in capsys.readouterr().err
    # --serving checks a profile's serving factors: none without --check, none to check in a
    # profile measured without workers
    assert cmd_profile(ap.parse_args(["--serving", "--device", "cpu"])) == 2
    assert "pass --check PROFILE" in capsys.readouterr().err
    # --check --out writes the profile scaled by the serving check: --serving it needs
    assert cmd_profile(ap.parse_args(["--check", str(make_profile().save(tmp_path / "p.json")),
                                      "--out", str(tmp_path / "now.json"),
                                      "--device", "cpu"])) == 2
    assert "pass --serving too" in capsys.readouterr().err
    assert not (tmp_path / "now.json").exists()
    bare = dataclasses.replace(make_profile(), served=[], served_prefill=[])
    assert cmd_profile(ap.parse_args(["--check", str(bare.save(tmp_path / "bare.json")),
                                      "--serving", "--device", "cpu"])) == 2
    assert "no serving measurements" in capsys.readouterr().err
    # a thread count the workers cannot run, or one with ranks (each runs one thread)
    assert cmd_profile(ap.parse_args(["--threads", "0", "--device", "cpu"])) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert cmd_profile(ap.parse_args(["--repeats", "0", "--device", "cpu"])) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert cmd_profile(ap.parse_args(["--threads", "2", "--tensor-parallel-size", "2",
                                      "--device", "cpu"])) == 2
    assert "--threads with --tensor-parallel-size" in capsys.readouterr().err


@pytest.mark.slow  # ~6-8 s: a tiny engine measured
def test_baton_profile_measures_a_worker_of_several_threads_on_cores_of_its_own(tiny_llama,
                                                                               tmp_path):
    """`baton profile --threads 2` times the engine as a `baton up --threads 2` worker runs:
    two torch threads on two cores of its own, a neighbour only on cores beyond them, and the
    profile says 2 (the live tuner checks the workers' threads against it)."""
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "profile", "--model", str(tiny_llama[0]),
         "--threads", "2", "--no-handoff", "--repeats", "1", "--out", str(tmp_path / "p.json")],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    cores = sorted(os.sched_getaffinity(0))
    mine = sorted({cores[i % len(cores)] for i in range(2)})
    assert (f"timing the engine: 2 torch thread(s) on core(s) {','.join(map(str, mine))}"
            in out.stderr)
    p = Profile.load(tmp_path / "p.json")
    assert p.threads == 2
    assert p.neighbors == [c for c in cores if c not in mine][:2]
    assert ("share cores" in out.stderr) == (len(cores) < 4)  # said when they cannot have their own


@pytest.mark.slow  # ~10 s: two tiny profiles started and stopped
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a neighbour needs a second core")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stopped_baton_profile_leaves_no_neighbour_running(tiny_llama, tmp_path, how):
    """`baton profile` runs a busy engine on another core while it times its own (the
    neighbour, which never stops on its own). Stopped with SIGTERM (`kill`, `timeout`) it
    stops the neighbour as Ctrl-C does, says so and writes nothing (exit 130); killed outright
    the neighbour goes with it (it gets SIGTERM when its parent dies). A neighbour left behind
    ran on through the next profile's serving part and doubled its serving factors."""
    import signal

    out = tmp_path / "p.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli.main", "profile", "--model", str(tiny_llama[0]),
         "--no-handoff", "--repeats", "3", "--out", str(out)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        neighbour, seen = None, []
        for line in proc.stderr:  # the neighbour is ready once the engine's timing begins
            seen.append(line)
            if "as the neighbour" in line:
                neighbour = True
            elif neighbour and " tokens in " in line:
                break
        assert neighbour, "".join(seen)
        (neighbour,) = [p for p in descendants(proc.pid)
                        if b"neighbor_load" in Path(f"/proc/{p}/cmdline").read_bytes()]
        proc.send_signal(getattr(signal, how))
        rc = proc.wait(timeout=120)
        deadline = 120  # the neighbour's exit is the event; this only bounds a failure
        while alive(neighbour) and deadline > 0:
            time.sleep(0.05)
            deadline -= 0.05
        left = alive(neighbour)
        if left:  # stopped here, or it would hold the stderr pipe open (and a core) for good
            os.kill(neighbour, signal.SIGKILL)
        rest = proc.stderr.read()
        assert not left, f"the neighbour {neighbour} still ran after {how}"
        assert rc == (130 if how == "SIGTERM" else -signal.SIGKILL), rest
        if how == "SIGTERM":
            assert "stopped: nothing written" in rest
        assert not out.exists()
    finally:
        proc.kill()
        proc.wait()


def test_the_measuring_workers_run_the_profiles_threads_on_groups_of_cores():
    """The workers `baton profile --threads N` and its serving check start run N torch threads,
    each on a group of N cores (wrapping round the cores given when there are too few)."""
    from baton.bench.profile import _groups, _worker_args

    flags = _worker_args(None, "bfloat16", "cpu", 1, [64], [], [], 4)
    assert flags[flags.index("--threads") + 1] == "4"
    assert _groups([0, 1, 2, 3, 4, 5, 6, 7], 4) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert _groups([0, 1, 2], 2) == [{0, 1}, {2, 0}]
    assert _groups([5, 6], 1) == [{5}, {6}]


def test_baton_tune_names_a_missing_profile(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "tune", "--trace",
         str(DATA / "azure_llm_2023_conv-head50.csv"), "--ttft-slo", "2", "--tpot-slo", "0.05",
         "--profile", str(tmp_path / "none.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "none.json" in out.stderr


def test_recommendation_prefers_colocated_on_a_tie():
    from baton.control.tune import recommend

    rows = [{"layout": "1P+1D", "prefill": 1, "decode": 1, "colocated": False,
             "goodput_rps": 1.0},
            {"layout": "2 colocated", "prefill": 0, "decode": 2, "colocated": True,
             "goodput_rps": 1.0}]
    assert recommend(rows).startswith("stay colocated")
    rows[0]["goodput_rps"] = 2.0
    assert "1 prefill + 1 decode" in recommend(rows) and "2.00x" in recommend(rows)
    assert not math.isnan(rows[0]["goodput_rps"])


def test_a_trace_past_every_configurations_goodput_is_said_with_what_serves_most_of_it():
    """`baton tune` on a trace that arrives faster than any configuration sustains does not
    recommend by goodput alone (each is under the trace's rate, and a tie says nothing): it
    says so, and names the configuration the simulator has serving most of the trace within
    the SLOs at its own times."""
    from baton.control.tune import arrival_rate, recommend

    rows = [{"layout": "1P+1D", "prefill": 1, "decode": 1, "colocated": False,
             "goodput_rps": 0.625, "attainment_at_trace_rate": 0.11},
            {"layout": "2 colocated", "prefill": 0, "decode": 2, "colocated": True,
             "goodput_rps": 0.5, "attainment_at_trace_rate": 0.32}]
    assert "1 prefill + 1 decode" in recommend(rows)  # goodput alone runs the split
    assert "1 prefill + 1 decode" in recommend(rows, 0.6)  # 0.6/s: the split sustains it
    past = recommend(rows, 0.8)
    assert past.startswith("the trace's 0.8 req/s is past every configuration's goodput "
                           "(the most 0.625)")
    assert "2 colocated serves the most of it within them (32%)" in past
    none = [{**r, "goodput_rps": 0.0} for r in rows]  # no rate at all: the SLOs are the advice
    assert recommend(none, 0.8).startswith("no configuration meets the SLOs at any rate")
    assert arrival_rate([0.0, 1.0, 2.0, 4.0]) == 0.75  # three gaps in four seconds
    assert arrival_rate([5.0]) is None and arrival_rate([]) is None
    assert arrival_rate([3.0, 3.0]) is None  # all at one instant: no rate


def test_a_profile_says_when_it_was_measured_and_checked():
    """What `baton tune` prints of its profile: when it was measured and how long ago, and the
    last serving check that scaled it, or the command that would; a profile from before the
    time was recorded says so."""
    p = dataclasses.replace(make_profile(), measured_at="2026-12-03T12:00:00Z")
    noon = 1_796_299_200.0  # 2026-12-03 12:00:00 UTC
    assert p.age(now=noon + 5400) == (
        "measured 2026-12-03T12:00:00Z, 1.5 h ago; `baton profile --check FILE --serving "
        "--out NEW` brings it to this machine's speed now in ~5 minutes")
    p.checked = [{"at": "2026-12-03T13:00:00Z", "source": "p.json", "decode_ratio": 1.31,
                  "prefill_ratio": 0.9}]
    assert p.age(now=noon + 5400) == (
        "measured 2026-12-03T12:00:00Z, 1.5 h ago; scaled by a serving check "
        "2026-12-03T13:00:00Z, 0.5 h ago (decode x1.310, prefill x0.900)")
    assert p.age(now=noon + 3 * 86400).startswith("measured 2026-12-03T12:00:00Z, 3 days ago")
    assert make_profile().age().startswith("measured at a time it does not record; ")


@pytest.mark.slow  # the real `baton profile` and its --check: 46 s alone on the 2-vCPU VM
def test_baton_profile_measures_an_engine_and_the_model_fits_it(tiny_llama, tmp_path):
    """`baton profile` on a tiny model, with real prefill and decode worker processes, a router
    and redis-server for the hand-off and serving measurements: every table is filled (as far
    as the model's 512-token context allows), and the cost model built on it reproduces its
    own measurements roughly."""
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "profile", "--model", str(tiny_llama[0]),
         "--repeats", "1", "--out", str(tmp_path / "p.json")],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "prefill  1024 tokens" in out.stderr and "decode batch" in out.stderr
    p = Profile.load(tmp_path / "p.json")
    others = sorted(os.sched_getaffinity(0))[1:2]
    assert p.neighbors == others  # measured beside a busy engine wherever there is a core for it
    assert (p.device, p.tensor_parallel_size) == ("cpu", 1)  # --device auto: no GPU here
    assert p.age().startswith(f"measured {p.measured_at}, 0.") and p.checked == []
    # the model as the workers register it, for the live tuner to check theirs against
    from baton.bench.profile import stream_slopes
    from baton.engine.loader import load_model

    model = load_model(tiny_llama[0])
    assert p.fingerprint == model.fingerprint(p.dtype, p.block_size, "cpu")
    # what a sampled row adds to a step, per sampler filter, timed on this model's logits
    assert set(p.sampling) == set(SAMPLING) and all(v >= 0 for v in p.sampling.values())
    assert f"sampling {SAMPLING_BATCH} rows of {model.config.vocab_size} logits" in out.stderr
    assert p.model_name == model.name
    assert ("as the neighbour" in out.stderr) == bool(others)
    assert [r["tokens"] for r in p.prefill] == [1, 4, 16, 32, 64, 128, 256, 512, 1024]
    assert p.decode and p.prefill_long
    # the decode grid on a fresh and on a scattered pool (the cost model's), timed in turn,
    # each point the median of its rounds
    assert [(r["batch"], r["context"]) for r in p.decode_fresh] == [
        (r["batch"], r["context"]) for r in p.decode]
    lines = [ln for ln in out.stderr.splitlines() if "decode batch" in ln]
    assert len(lines) == len(p.decode) + len(p.decode_fresh)
    assert all(ln.split("(rounds ")[1].count(",") == DECODE_ROUNDS - 1 for ln in lines)
    assert "scattered pool" in out.stderr and "fresh pool" in out.stderr
    assert [r["tokens"] for r in p.handoff] == [64, 256]  # 1024 does not fit the context
    assert p.handoff[1]["bytes"] == 4 * p.handoff[0]["bytes"] > 0
    # the grid's points that fit, timed once: --repeats 1 (SERVED_ROUNDS times with more)
    assert [(r["batch"], r["context"]) for r in p.served] == [(16, 128), (8, 384)]
    assert all(r["s"] > 0 and r["model_s"] > 0 for r in p.served)
    fresh = CostModel(dataclasses.replace(p, decode=p.decode_fresh))  # the workers' reference
    assert [r["model_s"] for r in p.served] == pytest.approx(
        [fresh.engine_step(r["batch"], 0, [r["context"] + sum(SERVED_TOKENS) // 2] * r["batch"])
         for r in p.served])
    assert p.serving_factor == pytest.approx(
        statistics.median(r["s"] / r["model_s"] for r in p.served))
    # the same grid with the prefill worker idle, in turn with the busy one: its own factor
    assert [(r["batch"], r["context"]) for r in p.served_idle] == [(16, 128), (8, 384)]
    assert [r["model_s"] for r in p.served_idle] == pytest.approx(
        [r["model_s"] for r in p.served])
    assert p.serving_factor_idle == pytest.approx(
        statistics.median(r["s"] / r["model_s"] for r in p.served_idle))
    assert "with the prefill worker idle" in out.stderr
    # and with the prefill worker switched to decode, twice the streams split over the two
    assert [(r["batch"], r["context"]) for r in p.served_decoding] == [(16, 128), (8, 384)]
    assert [r["model_s"] for r in p.served_decoding] == pytest.approx(
        [r["model_s"] for r in p.served])
    assert p.serving_factor_decoding == pytest.approx(
        statistics.median(r["s"] / r["model_s"] for r in p.served_decoding))
    assert "with it decoding as many" in out.stderr and "beside a decoding worker" in out.stderr
    # past the grid: SERVED_MANY (256-token contexts fit) in the three conditions;
    # the rise a stream is the median of the busy and the decoding rows' over their factors
    many = [(c, b) for c, b in SERVED_MANY]
    assert [(r["beside"], (r["context"], r["batch"])) for r in p.served_many] == [
        (cond, m) for cond in ("idle", "busy", "decoding") for m in many]
    assert all(r["model_s"] > 0 for r in p.served_many)
    risen = stream_slopes(p)
    assert p.serving_stream_slope == pytest.approx(
        max(0.0, statistics.median(risen["busy"] + risen["decoding"])))
    assert "rise per stream past" in out.stderr
    # the prefill worker prefilled its largest long prompt that fits, over and over, sent by
    # several clients so its queue never emptied, in windows with and without other streams
    # through the router; the factor and its rise are a line through the windows' throughput
    windows = [(k, [r for r in p.served_prefill if r["streams"] == k])
               for k in sorted({r["streams"] for r in p.served_prefill})]
    assert [k for k, _ in windows] == sorted(set(PREFILL_STREAMS))
    assert all(len(rows) >= SATURATED_PROMPTS * PREFILL_STREAMS.count(k) for k, rows in windows)
    assert all(r["streamed_tps"] > 0 for r in windows[-1][1])  # those streams ran meanwhile
    assert {r["tokens"] for r in p.served_prefill} == {256}
    assert all(r["s"] > 0 and r["model_s"] > 0 for r in p.served_prefill)
    assert (p.prefill_factor_saturated, p.prefill_stream_factor_saturated) == pytest.approx(
        prefill_factors(p.served_prefill, CostModel(p).engine_prompt))
    # then the prompts that fit the context one at a time, each after each idle gap, in a
    # window without other streams and one with them (--repeats 1: one round); the factors the
    # simulator charges are their latency, a line through the windows as the saturated ones
    fit = [n for n in LONE_PROMPTS if n + BUSY_OUTPUT + 2 <= 512]
    assert fit and [(r["streams"], r["gap"], r["tokens"]) for r in p.lone_prefill] == [
        (k, g, n) for k in LONE_STREAMS for g in LONE_GAPS for n in fit]
    assert all(r["s"] > 0 and r["model_s"] > 0 and r["queue_s"] >= 0 for r in p.lone_prefill)
    assert all(r["streamed_tps"] > 0 for r in p.lone_prefill if r["streams"])
    assert (p.prefill_factor, p.prefill_stream_factor) == pytest.approx(
        prefill_latency_factors(p.lone_prefill, CostModel(p).engine_prompt))
    assert p.prefill_factor > 0 and p.prefill_stream_factor >= 0
    assert "lone prompts:" in out.stderr
    assert "serving factors" in out.stderr and "served prefill   256 tokens" in out.stderr
    assert p.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4  # layers, k/v, kv heads, head dim, fp32
    cm = CostModel(p)
    # every coefficient but the offset of a step of decodes alone (either sign) is >= 0
    assert all(v >= 0 for k, v in cm.summary().items() if k != "decode_offset_s")
    big = p.prefill[-1]
    bare = CostModel(dataclasses.replace(p, serving_factor=1.0, prefill_factor=1.0))
    # the engine's own batched step is the table's point plus the fitted attention of its 16
    # prompts (not compared with a tolerance: this tiny model's timings on a loaded CI machine
    # moved the attention fit by half the point once, 41 ms against 26)
    assert big["tokens"] == 1024 and bare.tok(1024) == big["s"]
    assert bare.step([(64, 0)] * 16, []) == pytest.approx(
        big["s"] + bare.attn_prefill * 16 * 64 * 65 / 2)
    assert bare.attn_prefill >= 0
    assert cm.step([(64, 0)] * 16, []) == pytest.approx(p.prefill_factor
                                                        * bare.step([(64, 0)] * 16, []))
    # `baton profile --check`: the same machine against that profile, no profile written
    before = (tmp_path / "p.json").read_bytes()
    check = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "profile", "--check", str(tmp_path / "p.json"),
         "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    speed = json.loads(check.stdout.splitlines()[-1])
    assert speed["prefill_tokens"] == 1024
    assert speed["neighbour"] == bool(others)  # as the profile was measured
    assert speed["prefill_ratio"] == pytest.approx(speed["prefill_s"] / big["s"])
    ref = next(r for r in p.decode_fresh if (r["batch"], r["context"]) == (16, 128))
    assert speed["decode_ratio"] == pytest.approx(speed["decode_16x128_s"] / ref["s"])
    assert speed["prefill_s"] > 0 and speed["decode_16x128_s"] > 0
    assert "machine speed against the profile" in check.stderr
    assert (tmp_path / "p.json").read_bytes() == before
    # with --serving, the serving factors again on real workers, against the profile's: the
    # profile's own, computed as the profile computed them; with --out, the profile scaled by
    # them is written there, and the profile checked is left as it was
    check = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "profile", "--check", str(tmp_path / "p.json"),
         "--repeats", "1", "--serving", "--out", str(tmp_path / "now.json")],
        capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    serving = json.loads(check.stdout.splitlines()[-1])["serving"]
    assert serving["decode_factor_profile"] == pytest.approx(p.serving_factor)
    assert serving["decode_factor"] > 0 and serving["decode_ratio"] == pytest.approx(
        serving["decode_factor"] / p.serving_factor)
    assert serving["prefill_factor_saturated_profile"] == pytest.approx(
        p.prefill_factor_saturated)
    assert serving["prefill_factor_saturated"] > 0 and serving["prefill_ratio_saturated"] == (
        pytest.approx(serving["prefill_factor_saturated"]
                      / serving["prefill_factor_saturated_profile"]))
    # the ratio that scales the prefill factors is of the kind they are: this profile's are
    # lone prompts' latency (version 10), so the check times lone prompts too, the lengths the
    # profile timed, in each of the profile's windows (nothing streamed, and 16 other streams):
    # where the profile's factor rises with streaming, the check's line scales the intercept
    # and the rise each by its own ratio
    assert p.lone_prefill and serving["prefill_from"] == (
        "lone+streams" if p.prefill_stream_factor > 0 else "lone")
    assert serving["prefill_factor_profile"] == pytest.approx(p.prefill_factor)
    assert serving["prefill_factor"] > 0 and serving["prefill_ratio"] == pytest.approx(
        serving["prefill_factor"] / serving["prefill_factor_profile"])
    assert "prefill of lone prompts with nothing streamed" in check.stderr
    assert "16 other streams meanwhile" in check.stderr
    rise = serving.get("prefill_stream_ratio", serving["prefill_ratio"])
    # and the served grid beside a decoding worker, its ratio scaling that factor on its own
    assert p.serving_factor_decoding and serving["decode_factor_decoding"] > 0
    assert serving["decode_ratio_decoding"] == pytest.approx(
        serving["decode_factor_decoding"] / p.serving_factor_decoding)
    assert "the served decode grid again beside a decoding worker" in check.stderr
    assert "serving factors against the profile's" in check.stderr
    assert (tmp_path / "p.json").read_bytes() == before
    now = Profile.load(tmp_path / "now.json")
    assert now.serving_factor == pytest.approx(p.serving_factor * serving["decode_ratio"])
    assert now.prefill_factor == pytest.approx(p.prefill_factor * serving["prefill_ratio"])
    assert now.prefill_stream_factor == pytest.approx(p.prefill_stream_factor * rise)
    assert now.serving_factor_decoding == pytest.approx(p.serving_factor_decoding
                                                        * serving["decode_ratio_decoding"])
    assert now.prefill_factor_saturated == pytest.approx(p.prefill_factor_saturated
                                                         * serving["prefill_ratio"])
    assert now.prefill == p.prefill and now.fingerprint == p.fingerprint
    assert [(c["source"], c["decode_ratio"], c["prefill_ratio"]) for c in now.checked] == [
        (str(tmp_path / "p.json"), serving["decode_ratio"], serving["prefill_ratio"])]
    assert f"wrote {tmp_path / 'now.json'}" in check.stderr


def test_the_measuring_workers_pool_holds_the_grid_beside_the_busy_clients_hand_offs():
    """The pool `baton profile` and its serving check give their workers: the served grid's
    largest point and, beside it, one hand-off of the largest busy prompt per busy client (a
    pool sized for the grid alone left a 2,048-token hand-off waiting for room past the decode
    worker's --transfer-timeout while the 8 x 1,536-token streams prefilled, and the check
    failed with NoRoomError)."""
    from baton.bench.profile import _worker_args
    from baton.control.profile import BUSY_CLIENTS, BUSY_OUTPUT, SERVED

    def blocks(*args) -> int:
        flags = _worker_args(None, "bfloat16", "cpu", 1, *args)
        return int(flags[flags.index("--num-blocks") + 1])

    grid = list(SERVED)  # (context, streams)
    alone = blocks([], grid)
    assert alone >= max(b * -(-(c + SERVED_TOKENS[1]) // 16) for c, b in grid)
    beside = blocks([], grid, [512, 1024, 2048])
    assert beside - alone >= BUSY_CLIENTS * -(-(2048 + BUSY_OUTPUT) // 16)
    assert blocks([], grid, [256]) < beside  # the largest busy prompt sizes the room
    assert blocks([1024], [], []) >= 4 * 1024 // 16  # no grid: the hand-offs still fit


def test_the_batched_prefill_table_is_timed_warm_and_in_rounds(tiny_engine, monkeypatch):
    """`baton profile`'s batched prefill table on a real (tiny) engine: every size prefilled
    once untimed, then PREFILL_ROUNDS rounds over the sizes, each timed ``repeats`` times per
    round (timed cold, one size after the other, its 1- and 4-token rows came out above the
    decode grid's batch-1 steps on a 2-vCPU VM)."""
    import baton.bench.profile as bp

    eng = tiny_engine(num_kv_blocks=320, block_size=16)
    log, timing = [], []
    add = eng.add_request

    def logged_add(**kw):
        log.append((len(kw["prompt_token_ids"]), bool(timing)))
        return add(**kw)

    times = bp._times

    def timed(fn, repeats):
        timing.append(1)
        try:
            return times(fn, repeats)
        finally:
            timing.pop()

    monkeypatch.setattr(eng, "add_request", logged_add)
    monkeypatch.setattr(bp, "_times", timed)
    out = bp.measure_engine(eng, repeats=2, say=lambda s: None)
    k = PREFILL_PROMPT
    sizes = [[k] * (n // k) + ([n % k] if n % k else []) for n in PREFILL_TOKENS]
    warm = [(n, False) for lengths in sizes for n in lengths]
    rounds = [(n, True) for _ in range(PREFILL_ROUNDS) for lengths in sizes
              for _ in range(2) for n in lengths]
    assert log[:len(warm) + len(rounds)] == warm + rounds
    assert [r["tokens"] for r in out["prefill"]] == list(PREFILL_TOKENS)
    assert all(r["s"] > 0 for r in out["prefill"])
    assert not eng.has_unfinished() and eng.kv.pool.num_free_blocks == eng.num_blocks
    eng.check_integrity()


def _saturated_rows(engine, factor: float) -> list[dict]:
    """A serving check's saturated window: 250-token prompts queued, ending ``factor`` times
    the bare engine's (``engine``: a cost model's ``engine_prompt``) apart, nothing streamed."""
    return [{"tokens": 250, "end": i * factor * engine(250), "streams": 0,
             "streamed_tps": 0.0} for i in range(4)]


def _served_rows(p, factor: float) -> list[dict]:
    """A serving check's served decode grid: one point, 8 streams of 64 tokens, timed
    ``factor`` times ``p``'s bare engine's decode step on a fresh pool."""
    from baton.bench.profile import _served_model_s

    point = {"batch": 8, "context": 64}
    fresh = CostModel(dataclasses.replace(p, decode=p.decode_fresh or p.decode))
    return [{**point, "s": factor * _served_model_s(fresh, point)}]


def _lone_rows(engine, factor: float, streams: int = 0, tps: float = 0.0) -> list[dict]:
    """A serving check's lone window: prompts each ``factor`` times the bare engine's, with
    ``streams`` other streams at ``tps`` tokens a second meanwhile."""
    return [{"tokens": n, "s": factor * engine(n), "streams": streams, "streamed_tps": tps}
            for n in (143, 611)]


def test_a_serving_check_scales_the_prefill_factors_by_the_ratio_of_their_own_kind():
    """`baton profile --check --serving`'s prefill ratio is of the kind the profile's prefill
    factors are: a version-10 profile's are lone prompts' latency, so the lone window's ratio
    scales them (on 2026-12-06 a saturated window read 1.00x the profile's while the bare engine
    and the run's calibration read 1.05x); the saturated window's ratio is kept beside it, and
    is the one used for a profile without lone prompts."""
    from baton.bench.profile import serving_factors

    p = make_profile()
    engine = CostModel(p).engine_prompt  # the bare engine: tok(n), 250 tokens a second

    def saturated(factor: float) -> list[dict]:
        return _saturated_rows(engine, factor)

    def lone(factor: float) -> list[dict]:  # nothing streamed
        return _lone_rows(engine, factor)

    p.served = [{"batch": 8, "context": 64, "s": 0.05}]
    # a version-10 profile: lone prompts' latency as its prefill factor (1.0 with nothing
    # streamed, rising with streaming), the saturated throughput kept beside (1.1)
    p.serving_factor, p.prefill_factor, p.prefill_stream_factor = 1.1, 1.0, 0.001
    p.prefill_factor_saturated, p.prefill_stream_factor_saturated = 1.1, 0.001
    served = _served_rows(p, 1.21)
    out = serving_factors(p, served, saturated(1.1), lone(1.05))
    assert out["decode_factor"] == pytest.approx(1.21)
    assert out["decode_ratio"] == pytest.approx(1.1)
    assert out["prefill_from"] == "lone"
    assert out["prefill_factor"] == pytest.approx(1.05)
    assert out["prefill_factor_profile"] == pytest.approx(1.0)
    assert out["prefill_ratio"] == pytest.approx(1.05)
    assert out["prefill_factor_saturated_profile"] == pytest.approx(1.1)
    assert out["prefill_ratio_saturated"] == pytest.approx(1.0)
    # checked against what the profile says now: once scaled by this check, the same machine
    # reads 1.0x (against the rows the profile was fitted on it would read 1.05x again, and a
    # second `--check --serving --out` would scale it twice)
    again = serving_factors(checked(p, out, "the check above"), served, saturated(1.1),
                            lone(1.05))
    assert again["prefill_ratio"] == pytest.approx(1.0)
    assert again["decode_ratio"] == pytest.approx(1.0)
    # a profile without lone prompts (version 9 and before): its prefill factor is the
    # saturated throughput, and the saturated window's ratio scales it
    old = dataclasses.replace(p, prefill_factor=1.1, prefill_factor_saturated=None,
                              prefill_stream_factor_saturated=None)
    out = serving_factors(old, served, saturated(1.1), [])
    assert out["prefill_from"] == "saturated"
    assert out["prefill_factor_saturated_profile"] == pytest.approx(1.1)
    assert out["prefill_ratio"] == pytest.approx(1.0) == out["prefill_ratio_saturated"]
    # a check whose lone window timed nothing falls back to the saturated ratio too
    assert serving_factors(p, served, saturated(1.1), [])["prefill_from"] == "saturated"


def test_a_serving_check_that_times_lone_prompts_beside_streams_scales_the_rise_on_its_own():
    """`baton profile --check --serving` times the profile's lone prompts in each of the
    profile's windows, with other streams running too: where the profile's factor rises with
    streaming, the check's line through its windows scales the intercept (``prefill_ratio``)
    and the rise (``prefill_stream_ratio``) each by its own ratio (on 2026-12-06 a prefill
    worker beside a streaming decode worker ran 1.26x the profile's simulation where lone
    prompts with nothing streamed read 1.05x); the idle windows' ratio is kept beside."""
    from baton.bench.profile import serving_factors

    p = make_profile()
    engine = CostModel(p).engine_prompt

    def lone(factor: float, streams: int = 0, tps: float = 0.0) -> list[dict]:
        return _lone_rows(engine, factor, streams, tps)

    saturated = _saturated_rows(engine, 1.0)
    p.served = [{"batch": 8, "context": 64, "s": 0.05}]
    p.serving_factor, p.prefill_factor, p.prefill_stream_factor = 1.1, 1.0, 0.001
    p.prefill_factor_saturated, p.prefill_stream_factor_saturated = 1.0, 0.001
    served = _served_rows(p, 1.1)
    # now: 1.05 with nothing streamed, 1.05 + 0.002 per token a second streamed (the rise
    # twice the profile's), as the profile's windows come: idle, then 16 streams
    now = lone(1.05) + lone(1.05 + 0.002 * 200, 16, 200.0)
    out = serving_factors(p, served, saturated, now)
    assert out["prefill_from"] == "lone+streams"
    assert out["prefill_factor"] == pytest.approx(1.05)
    assert out["prefill_ratio"] == pytest.approx(1.05)
    assert out["prefill_ratio_idle"] == pytest.approx(1.05)
    assert out["prefill_stream_factor"] == pytest.approx(0.002)
    assert out["prefill_stream_factor_profile"] == pytest.approx(0.001)
    assert out["prefill_stream_ratio"] == pytest.approx(2.0)
    assert out["streamed_tps"] == pytest.approx(200.0)
    scaled = checked(p, out, "the check above")
    assert scaled.prefill_factor == pytest.approx(1.05)
    assert scaled.prefill_stream_factor == pytest.approx(0.002)
    # the scaled profile, checked again on the same machine, reads 1.0x in both parts
    again = serving_factors(scaled, served, saturated, now)
    assert again["prefill_ratio"] == pytest.approx(1.0)
    assert again["prefill_stream_ratio"] == pytest.approx(1.0)
    # a streamed window no slower than the idle one: no rise now (the line is the mean)
    flat = serving_factors(p, served, saturated, lone(1.05) + lone(1.0, 16, 200.0))
    assert flat["prefill_stream_ratio"] == 0.0
    assert flat["prefill_ratio"] == pytest.approx(1.025)
    assert flat["prefill_ratio_idle"] == pytest.approx(1.05)
    # a profile whose factor does not rise with streaming: one ratio, the idle windows'
    level = dataclasses.replace(p, prefill_stream_factor=0.0)
    out = serving_factors(level, served, saturated, now)
    assert out["prefill_from"] == "lone" and "prefill_stream_ratio" not in out
    assert out["prefill_ratio"] == pytest.approx(1.05)


def test_a_serving_check_beside_a_decoding_worker_scales_that_decode_factor_on_its_own():
    """`baton profile --check --serving` runs the served decode grid beside a decoding worker
    too (as two colocated workers decode, the factor the simulator charges them): its ratio to
    the profile's ``serving_factor_decoding`` scales that factor alone (on 2026-12-07 a
    profile's 1.362 there, against 1.237 in the two before it, left two colocated workers
    predicted 18% under what they served), the busy grid's ratio the rest."""
    from baton.bench.profile import serving_factors

    p = make_profile()
    p.served = [{"batch": 8, "context": 64, "s": 0.05}]
    p.serving_factor, p.serving_factor_idle, p.serving_factor_decoding = 1.1, 1.0, 1.4

    # the prefill worker saturated as the profile says
    busy = _saturated_rows(CostModel(p).engine_prompt, p.prefill_factor)
    out = serving_factors(p, _served_rows(p, 1.21), busy, [], _served_rows(p, 1.26))
    assert out["decode_ratio"] == pytest.approx(1.1)
    assert out["decode_factor_decoding"] == pytest.approx(1.26)
    assert out["decode_factor_decoding_profile"] == pytest.approx(1.4)
    assert out["decode_ratio_decoding"] == pytest.approx(0.9)
    now = checked(p, out, "the check above")
    assert now.serving_factor == pytest.approx(1.21)
    assert now.serving_factor_idle == pytest.approx(1.1)
    assert now.serving_factor_decoding == pytest.approx(1.26)
    assert now.checked[-1]["decode_ratio_decoding"] == pytest.approx(0.9)
    again = serving_factors(now, _served_rows(p, 1.21), busy, [], _served_rows(p, 1.26))
    assert again["decode_ratio_decoding"] == pytest.approx(1.0)
    assert again["prefill_ratio"] == pytest.approx(1.0)
    # without that grid, or for a profile that did not measure it, the one decode ratio
    assert "decode_ratio_decoding" not in serving_factors(p, _served_rows(p, 1.21), busy, [])
    old = dataclasses.replace(p, serving_factor_decoding=None)
    assert "decode_ratio_decoding" not in serving_factors(old, _served_rows(p, 1.21), busy, [],
                                                          _served_rows(p, 1.26))


def test_prefill_throughput_factor_is_wall_time_over_the_engine_work_completed():
    rows = [{"tokens": 100, "end": 10.0}, {"tokens": 300, "end": 13.0},
            {"tokens": 200, "end": 11.0}]  # in any order
    # from the first completion (10.0) to the last (13.0): 3 s for the 200 + 300 tokens after it
    assert prefill_throughput_factor(rows, lambda n: n / 250) == pytest.approx(3.0 / 2.0)
    # two prompts ending together (one batched step) count once each
    rows.append({"tokens": 300, "end": 13.0})
    assert prefill_throughput_factor(rows, lambda n: n / 250) == pytest.approx(3.0 / 3.2)
    assert prefill_throughput_factor(rows[:2], lambda n: 1.0) is None


def test_prefill_factors_are_a_line_through_each_windows_throughput_against_streaming():
    def window(streams: int, tps: float, t0: float, factor: float) -> list[dict]:
        # three 250-token prompts (1 s each on the bare engine) ending ``factor`` s apart
        return [{"tokens": 250, "end": t0 + i * factor, "streams": streams,
                 "streamed_tps": tps} for i in range(3)]

    engine = lambda n: n / 250  # noqa: E731
    rows = (window(0, 2.0, 0, 1.1) + window(16, 402.0, 10, 1.5) + window(0, 2.0, 20, 1.1)
            + window(16, 402.0, 30, 1.5))
    f0, rise = prefill_factors(rows, engine)
    assert rise == pytest.approx(0.4 / 400)  # 1.1 at 2 tokens/s, 1.5 at 402
    assert f0 == pytest.approx(1.1 - 2 * 0.4 / 400)
    # windows alike in their streaming: their mean, no rise
    assert prefill_factors(window(0, 0.0, 0, 1.1) + window(4, 0.0, 10, 1.3), engine) == (
        pytest.approx(1.2), 0.0)
    # a factor that falls with streaming is noise, not a saving: the mean, no rise
    assert prefill_factors(window(0, 0.0, 0, 1.3) + window(16, 400.0, 10, 1.1), engine) == (
        pytest.approx(1.2), 0.0)
    assert prefill_factors(window(0, 0.0, 0, 1.1)[:2], engine) is None


def test_lone_prompts_give_the_prefill_factors_as_their_latency_over_the_bare_engines():
    engine = lambda n: n / 250  # noqa: E731  (1 s on the bare engine a 250-token prompt)

    def window(streams: int, tps: float, rows: list[tuple[int, float]]) -> list[dict]:
        return [{"tokens": n, "s": s, "gap": 0.25, "streams": streams, "streamed_tps": tps}
                for n, s in rows]

    # summed, not averaged by prompt: a 1000-token prompt 10% dear outweighs a 100-token one
    # 50% dear (what a TTFT feels)
    idle = window(0, 1.0, [(100, 0.6), (1000, 4.4)])
    assert prefill_latency_factor(idle, engine) == pytest.approx(5.0 / 4.4)
    assert prefill_latency_factor([], engine) is None
    # a line through the windows against the tokens streamed, as the saturated factors
    busy = window(16, 401.0, [(100, 0.8), (1000, 4.7)])
    f0, rise = prefill_latency_factors(idle + busy + idle + busy, engine)
    slope = (5.5 / 4.4 - 5.0 / 4.4) / 400
    assert rise == pytest.approx(slope) and f0 == pytest.approx(5.0 / 4.4 - slope)
    assert prefill_latency_factors([], engine) is None


def test_a_version_10_profile_keeps_the_saturated_factors_and_scales_them_with_the_rest():
    p = dataclasses.replace(make_profile(), prefill_factor=1.05, prefill_stream_factor=0.001,
                            prefill_factor_saturated=0.95, prefill_stream_factor_saturated=0.002)
    assert CostModel(p).prefill_factor == 1.05  # the simulator charges the latency
    now = checked(p, {"decode_ratio": 1.0, "prefill_ratio": 1.1}, "p.json")
    assert (now.prefill_factor, now.prefill_stream_factor, now.prefill_factor_saturated,
            now.prefill_stream_factor_saturated) == pytest.approx((1.155, 0.0011, 1.045, 0.0022))
    assert checked(make_profile(), {"decode_ratio": 1.0, "prefill_ratio": 1.1},
                   "p.json").prefill_factor_saturated is None


def test_a_prefill_step_costs_more_while_the_cluster_streams_tokens():
    p = dataclasses.replace(make_profile(), prefill_factor=1.1, prefill_stream_factor=0.001,
                            serving_factor=1.2)
    cm, bare = CostModel(p), CostModel(dataclasses.replace(p, prefill_factor=1.0,
                                                           prefill_stream_factor=0.0,
                                                           serving_factor=1.0))
    chunk = [(256, 0)]
    assert cm.step(chunk, []) == pytest.approx(1.1 * bare.step(chunk, []))
    assert cm.step(chunk, [], streamed_tps=300) == pytest.approx(1.4 * bare.step(chunk, []))
    assert cm.step([], [64] * 8, streamed_tps=300) == pytest.approx(1.2 * bare.step([], [64] * 8))


def test_the_simulator_slows_prefill_by_the_tokens_it_streams():
    """Same prompts; long outputs stream tokens while later prompts prefill, and with a
    streaming rise in the profile those prompts take longer to their first token."""
    base = make_profile()
    rising = dataclasses.replace(base, prefill_stream_factor=0.01)
    shape = [(512, 200, i * 0.05) for i in range(20)]  # prompt, output, arrival
    ttft = {}
    for name, p in (("flat", base), ("rising", rising)):
        done = simulate(Layout(1, 1), p, shape)
        assert all(r.error is None for r in done)
        ttft[name] = sum(r.first - r.sent for r in done)
    assert ttft["rising"] > 1.2 * ttft["flat"]
    # with one-token outputs nothing streams while prompts prefill: the rise costs nothing
    short = [(n, 1, t) for n, _, t in shape]
    assert [r.first for r in simulate(Layout(1, 1), rising, short)] == pytest.approx(
        [r.first for r in simulate(Layout(1, 1), base, short)])


def test_a_decode_step_costs_more_while_the_other_workers_run_steps():
    """The decode factor runs from the profile's idle one (the other workers idle) to its
    busy one; a profile without the idle grid (version 6) has one factor for both."""
    p = dataclasses.replace(make_profile(), serving_factor=1.3, serving_factor_idle=1.1)
    cm, bare = CostModel(p), CostModel(make_profile())
    decodes = [200] * 16
    assert cm.step([], decodes, others_busy=0.0) == pytest.approx(1.1 * bare.step([], decodes))
    assert cm.step([], decodes, others_busy=1.0) == pytest.approx(1.3 * bare.step([], decodes))
    assert cm.step([], decodes) == cm.step([], decodes, others_busy=1.0)  # as the grid was
    assert cm.step([], decodes, others_busy=0.5) == pytest.approx(1.2 * bare.step([], decodes))
    assert cm.decode_factor(2.0) == cm.decode_factor(1.0)  # a share, clamped
    chunk = [(256, 0)]  # a prompt's factor is the prefill one, idle or busy
    assert cm.step(chunk, [], others_busy=0.0) == cm.step(chunk, [], others_busy=1.0)
    flat = CostModel(dataclasses.replace(p, serving_factor_idle=None))
    assert flat.decode_factor(0.0) == flat.decode_factor(1.0) == 1.3
    # the other workers' decode part of their busy share moves it toward the decoding factor
    # (a version-7 profile has none: its busy one)
    assert cm.decode_factor(1.0, 1.0) == cm.decode_factor(1.0) == 1.3
    dec = CostModel(dataclasses.replace(p, serving_factor_decoding=1.9))
    assert dec.decode_factors_differ
    assert dec.step([], decodes, others_busy=1.0, others_decoding=1.0) == pytest.approx(
        1.9 * bare.step([], decodes))
    assert dec.decode_factor(1.0, 0.5) == pytest.approx(1.1 + 0.2 * 0.5 + 0.8 * 0.5)
    assert dec.decode_factor(0.5, 0.5) == pytest.approx(1.1 + 0.8 * 0.5)
    assert dec.decode_factor(0.5, 1.0) == dec.decode_factor(0.5, 0.5)  # a part of the share
    assert dec.decode_factor(1.0) == pytest.approx(1.3)  # the old callers: the busy factor
    only = CostModel(dataclasses.replace(p, serving_factor_idle=None, serving_factor_decoding=2))
    assert only.decode_factors_differ and only.decode_factor(0.0) == 1.3


def test_a_decode_step_past_the_grid_costs_more_a_stream_beside_busy_workers():
    """A version-9 profile's rise per stream past STREAM_SLOPE_ABOVE (its served rows past the
    grid, beside a busy or a decoding worker), times the others' busy share: none beside idle
    workers, none at or under the grid's streams; a calibration scales it with the factors."""
    from baton.control.calibrate import scaled
    from baton.control.profile import STREAM_SLOPE_ABOVE

    p = dataclasses.replace(make_profile(), serving_factor=1.3, serving_factor_idle=1.1,
                            serving_stream_slope=0.004)
    cm, bare = CostModel(p), CostModel(make_profile())
    past = STREAM_SLOPE_ABOVE + 50
    assert cm.decode_factors_differ
    assert cm.decode_factor(1.0, 0.0, past) == pytest.approx(1.3 + 0.2)
    assert cm.decode_factor(0.5, 0.0, past) == pytest.approx(1.2 + 0.1)
    assert cm.decode_factor(0.0, 0.0, past) == pytest.approx(1.1)
    assert cm.decode_factor(1.0, 0.0, STREAM_SLOPE_ABOVE) == pytest.approx(1.3)
    assert cm.step([], [200] * past, others_busy=1.0) == pytest.approx(
        1.5 * bare.step([], [200] * past))
    # a step that prefills too: its decode tokens at the risen factor, its prompt's at the
    # prefill one
    mixed = cm.step([(64, 0)], [200] * past, others_busy=1.0)
    assert mixed == pytest.approx((64 * cm.prefill_factor + past * 1.5) / (64 + past)
                                  * bare.step([(64, 0)], [200] * past))
    assert scaled(p, 2.0, 1.0, "remote").serving_stream_slope == pytest.approx(0.008)
    # the slope alone makes the others' share matter
    flat = CostModel(dataclasses.replace(make_profile(), serving_stream_slope=0.004))
    assert flat.decode_factors_differ


def test_the_rise_a_stream_is_each_row_past_the_grid_over_its_conditions_factor():
    from baton.bench.profile import stream_slopes
    from baton.control.profile import STREAM_SLOPE_ABOVE

    p = dataclasses.replace(make_profile(), serving_factor=1.2, serving_factor_idle=1.0,
                            serving_factor_decoding=1.4)
    n = STREAM_SLOPE_ABOVE + 10
    p.served_many = [{"batch": n, "context": 256, "s": f * 0.1, "model_s": 0.1, "beside": c}
                     for c, f in (("idle", 1.01), ("busy", 1.25), ("decoding", 1.46),
                                  ("busy", 1.3))]
    p.served_many.append({"batch": STREAM_SLOPE_ABOVE, "context": 256, "s": 1, "model_s": 0.1,
                          "beside": "busy"})  # at the threshold: no slope to read
    got = stream_slopes(p)
    assert got["idle"] == pytest.approx([0.001])
    assert got["busy"] == pytest.approx([0.005, 0.01])
    assert got["decoding"] == pytest.approx([0.006])


def test_a_version_8_profile_reads_with_a_factor_flat_in_the_streams(tmp_path):
    d = dataclasses.asdict(make_profile())
    for k in ("served_many", "serving_stream_slope"):
        del d[k]
    d["version"] = 8
    (tmp_path / "p.json").write_text(json.dumps(d))
    p = Profile.load(tmp_path / "p.json")
    assert (p.version, p.serving_stream_slope) == (8, 0.0)
    cm = CostModel(p)
    assert cm.decode_factor(1.0, 0.0, 64) == cm.decode_factor(1.0, 0.0, 1)


def test_a_version_6_profile_reads_with_one_decode_factor(tmp_path):
    d = dataclasses.asdict(make_profile())
    for k in ("served_idle", "serving_factor_idle"):
        del d[k]
    d["version"], d["serving_factor"] = 6, 1.2
    (tmp_path / "p.json").write_text(json.dumps(d))
    p = Profile.load(tmp_path / "p.json")
    assert (p.version, p.serving_factor_idle) == (6, None)
    assert CostModel(p).decode_factor(0.0) == 1.2


def test_a_version_7_profile_reads_with_its_busy_factor_beside_a_decoding_worker(tmp_path):
    d = dataclasses.asdict(make_profile())
    for k in ("served_decoding", "serving_factor_decoding"):
        del d[k]
    d["version"], d["serving_factor"], d["serving_factor_idle"] = 7, 1.3, 1.1
    (tmp_path / "p.json").write_text(json.dumps(d))
    p = Profile.load(tmp_path / "p.json")
    assert (p.version, p.serving_factor_decoding) == (7, None)
    cm = CostModel(p)
    assert cm.decode_factor(1.0, 1.0) == cm.decode_factor(1.0, 0.0) == 1.3
    assert cm.decode_factor(0.0) == 1.1


def test_the_simulator_decodes_faster_beside_an_idle_prefill_worker():
    """1P+1D: short prompts stay on the decode worker (the local path), so with nothing else
    the prefill worker is idle and the decode steps run at the idle factor; long prompts
    meanwhile keep it busy, and the same decodes run slower. Two colocated workers that both
    decode see each other busy."""
    p = dataclasses.replace(make_profile(), serving_factor=1.5, serving_factor_idle=1.0)
    flat = dataclasses.replace(p, serving_factor_idle=None)
    short = [(32, 100, i * 0.01) for i in range(8)]  # local path, decoding ~together
    idle = simulate(Layout(1, 1), p, short)
    assert all(r.path == "local" for r in idle)
    assert [r.tpot for r in idle] == pytest.approx(
        [r.tpot for r in simulate(Layout(1, 1), dataclasses.replace(flat, serving_factor=1.0),
                                  short)])
    # long prompts through the prefill worker, one after another while the short ones decode
    busy_shape = short + [(4000, 1, 0.1 + i * 0.05) for i in range(40)]
    busy = [r for r in simulate(Layout(1, 1), p, busy_shape) if r.prompt_tokens == 32]
    assert statistics.median(r.tpot for r in busy) > 1.3 * statistics.median(
        r.tpot for r in idle)
    # colocated, every request on one worker or the other: both decode, each busy beside the
    # other, so the factor is near the busy one
    pair = simulate(Layout(0, 2, colocated=True), p, short)
    busy_pair = simulate(Layout(0, 2, colocated=True), flat, short)
    assert statistics.median(r.tpot for r in pair) > 0.9 * statistics.median(
        r.tpot for r in busy_pair)


def test_two_colocated_workers_decode_slower_beside_each_other_decoding():
    """Two colocated workers that both decode are charged the profile's decoding factor (each
    beside the other's decode steps); a 1P+1D decode worker beside a prefill worker that only
    prefills is charged the busy one, whatever the decoding factor; with nothing else running
    (local path, the prefill worker idle) the idle one."""
    p = dataclasses.replace(make_profile(), serving_factor=1.3, serving_factor_idle=1.0)
    dec = dataclasses.replace(p, serving_factor_decoding=2.0)
    short = [(32, 200, i * 0.005) for i in range(16)]  # both workers decode, together
    pair = simulate(Layout(0, 2, colocated=True), dec, short)
    at_busy = simulate(Layout(0, 2, colocated=True), p, short)
    ratio = statistics.median(r.tpot for r in pair) / statistics.median(r.tpot for r in at_busy)
    assert 1.35 < ratio <= 2.0 / 1.3 + 1e-9  # near the decoding factor over the busy one
    # 1P+1D: long prompts keep the prefill worker prefilling while the short ones decode
    shape = short[:8] + [(4000, 1, 0.1 + i * 0.05) for i in range(40)]
    one = [r.tpot for r in simulate(Layout(1, 1), dec, shape) if r.prompt_tokens == 32]
    other = [r.tpot for r in simulate(Layout(1, 1), p, shape) if r.prompt_tokens == 32]
    assert one == pytest.approx(other)
    alone = simulate(Layout(1, 1), dec, short[:8])
    assert [r.tpot for r in alone] == pytest.approx(
        [r.tpot for r in simulate(Layout(1, 1), p, short[:8])])


def test_tier_weights_are_the_share_of_prefill_time_a_load_saves():
    from baton.control.profile import tier_weights

    p = make_profile()
    assert tier_weights(p) == {}  # no tier measured: the router keeps its defaults
    per_token = CostModel(p).engine_prompt(1024) / 1024
    p.tier_load = [{"tier": "host", "blocks": 64, "bytes": 0, "s": 0.1 * per_token * 64 * 16},
                   {"tier": "disk", "blocks": 64, "bytes": 0, "s": 0.4 * per_token * 64 * 16},
                   {"tier": "slow", "blocks": 1, "bytes": 0, "s": 10.0}]
    assert tier_weights(p) == {"host": 0.9, "disk": 0.6, "slow": 0.0}
    p.prefill_factor = 2.0  # a serving worker prefills at half the bare engine's speed
    assert tier_weights(p)["disk"] == 0.8


def test_decode_admission_waits_for_a_slot_as_the_router_does():
    """max_num_seqs 2 on the one decode worker: the third request waits in the router's decode
    queue (sent to no worker) until one of the first two ends, then runs; the batch never
    exceeds 2. It used to join the batch as a third sequence."""
    p = make_profile(seqs=2)
    a, b, c = simulate(Layout(0, 1, colocated=True), p, [(20, 10, 0.0)] * 3)
    assert c.first >= min(a.end, b.end)
    assert c.ttft > a.ttft and c.ttft > b.ttft
    # the same on the disaggregated path: the hand-off waits for a decode slot
    a, b, c = simulate(Layout(1, 1), p, [(300, 10, 0.0)] * 3)
    assert c.first >= min(a.end, b.end) and c.path == "remote"
    # and a request arriving while others wait joins the line behind them
    reqs = simulate(Layout(0, 1, colocated=True), make_profile(seqs=1),
                    [(20, 5, 0.0), (20, 5, 0.001), (20, 5, 0.002)])
    assert reqs[0].end <= reqs[1].first and reqs[1].end <= reqs[2].first


# ---- prefix hits, KV tiers, TP per pool, the profile's device -----------------------------------


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 5000 + 100 for i in range(n)]


def test_a_held_prefix_is_not_prefilled_again_and_the_router_goes_where_it_is():
    p, a, b = make_profile(), _prompt(1, 320), _prompt(2, 320)
    shape = [(320, 2, 0.0, block_keys(a, 16)), (320, 2, 5.0, block_keys(b, 16)),
             (320, 2, 10.0, block_keys(a, 16)), (320, 2, 15.0, block_keys(b, 16))]
    first_a, first_b, again_a, again_b = simulate(Layout(0, 2, colocated=True), p, shape)
    assert first_a.ttft == pytest.approx(0.004 + tok(320))  # all computed
    # each again on the worker that holds it (the prefix term outweighs the others), whose
    # engine computes only the last token for the logits
    for r in (again_a, again_b):
        assert r.ttft == pytest.approx(0.004 + tok(1))
        assert r.cached_tokens == 319  # recorded as the gRPC API's usage.cached_tokens
    assert first_a.cached_tokens == first_b.cached_tokens == 0
    unkeyed = simulate(Layout(0, 2, colocated=True), p, [x[:3] for x in shape])
    assert unkeyed[2].ttft == pytest.approx(0.004 + tok(320))  # no keys, no hits


def test_the_pd_decision_counts_only_what_the_decode_worker_lacks():
    keys = block_keys(_prompt(3, 320), 16)
    first, again = simulate(Layout(1, 1), make_profile(), [(320, 3, 0.0, keys),
                                                          (320, 3, 5.0, keys)])
    # the hand-off left the prompt's blocks on the decode worker: 0 new tokens, local
    assert (first.path, again.path) == ("remote", "local")


def test_evicted_prefixes_come_back_from_a_host_tier_at_its_load_cost():
    """A 30-block pool: B's 20 blocks push A's first 10 out. With a host tier they are loaded
    back (1 ms a block, as profiled) and nothing is computed again; without one, A's prefix is
    gone from its first block on and all of it is computed."""
    p = dataclasses.replace(make_profile(blocks=30), tier_load=[
        {"tier": "host", "blocks": 64, "bytes": 64 * 16000, "s": 0.064}])
    a, b = block_keys(_prompt(4, 320), 16), block_keys(_prompt(5, 320), 16)
    shape = [(320, 2, 0.0, a), (320, 2, 5.0, b), (320, 2, 10.0, a)]
    *_, tiered = simulate(Layout(0, 1, True), p, shape, Knobs(host_tier_blocks=100))
    # 19 blocks used (the last token is computed), A's first 10 from the host tier
    assert tiered.ttft == pytest.approx(0.004 + 10 * 0.001 + tok(1))
    *_, lost = simulate(Layout(0, 1, True), p, shape)
    assert lost.ttft == pytest.approx(0.004 + tok(320))


def test_each_pool_is_costed_at_its_own_tensor_parallel_size():
    one = make_profile()
    two = dataclasses.replace(make_profile(), tensor_parallel_size=2, prefill=[
        {"tokens": n, "requests": 1, "s": tok(n) / 2} for n in (1, 16, 256, 1024)])
    (r1,) = simulate(Layout(1, 1), one, [(300, 3, 0.0)])
    (r2,) = simulate(Layout(1, 1, False, 2, 1), one, [(300, 3, 0.0)], profiles={2: two})
    assert Layout(1, 1, False, 2, 1).name == "1P(TP2)+1D(TP1)"
    saved = CostModel(one).step([(300, 0)], []) - CostModel(two).step([(300, 0)], [])
    assert saved > 0 and r1.ttft - r2.ttft == pytest.approx(saved)  # the TP2 prefill
    assert r1.tpot == pytest.approx(r2.tpot)  # the decode pool is TP1 in both
    with pytest.raises(ValueError, match="no profile at tensor-parallel size 2"):
        simulate(Layout(1, 1, False, 2, 1), one, [(300, 3, 0.0)])


def _tune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "tune", "--trace",
         str(DATA / "azure_llm_2023_conv-head50.csv"), "--ttft-slo", "2", "--tpot-slo", "0.05",
         "--requests", "20", "--scale", "0.25", "--no-plot", *args],
        capture_output=True, text=True, timeout=300)


def test_a_profile_whose_prefill_table_and_decode_grid_disagree_is_warned_of(tmp_path, capsys):
    """The prefill table's 1-token step and the decode grid's batch-1 step are one engine step
    each: more than 15% apart, `baton profile --refit` and `baton tune` say so, naming both."""
    import argparse

    from baton.bench.profile import add_profile_args, cmd_profile

    p = make_profile()  # 1 token: 11 ms in both
    assert p.table_vs_grid() is None
    for scale, said in ((1.1, None), (0.9, None), (1.2, "+20%"), (0.8, "-20%")):
        q = dataclasses.replace(p, prefill=[{**r, "s": r["s"] * (scale if r["tokens"] == 1
                                                                 else 1)} for r in p.prefill])
        gap = q.table_vs_grid()
        assert (gap is None) == (said is None), (scale, gap)
        if said:
            assert f"differ by {said}" in gap and "batch-1 step at context 64 (11.0 ms)" in gap
    slow = dataclasses.replace(p, prefill=[{**r, "s": r["s"] * 1.3} for r in p.prefill])
    assert "1-token step (14.3 ms)" in slow.table_vs_grid()
    assert dataclasses.replace(p, decode=[]).table_vs_grid() is None
    assert dataclasses.replace(slow, device="cuda").table_vs_grid() is None  # CUDA graphs
    src = dataclasses.replace(slow, served=[{"batch": 4, "context": 768, "s": 0.02}]).save(
        tmp_path / "slow.json")
    ap = argparse.ArgumentParser()
    add_profile_args(ap)
    assert cmd_profile(ap.parse_args(["--refit", str(src), "--out", str(tmp_path / "v.json"),
                                      "--device", "cpu"])) == 0
    assert "warning: its prefill table's 1-token step" in capsys.readouterr().err
    out = _tune("--profile", str(src), "--out", str(tmp_path / "t"))
    assert out.returncode == 0, out.stderr
    assert "[baton tune] warning: the profile: its prefill table's" in out.stderr
    assert "warning" not in _tune("--profile", str(p.save(tmp_path / "ok.json")), "--out",
                                  str(tmp_path / "ok")).stderr


def test_baton_tune_sizes_each_pool_from_its_profile(tmp_path):
    one = make_profile(per_seq=0.002).save(tmp_path / "tp1.json")
    two = dataclasses.replace(make_profile(per_seq=0.001), tensor_parallel_size=2).save(
        tmp_path / "tp2.json")
    out = _tune("--profile", str(one), "--tp-profile", str(two), "--decode-tp", "2",
                "--out", str(tmp_path / "t"))
    assert out.returncode == 0, out.stderr
    res = json.loads((tmp_path / "t.json").read_text())
    assert {r["layout"] for r in res["configurations"]} == {"1P(TP1)+1D(TP2)",
                                                         "2 colocated (TP2)"}
    assert "costs measured on cpu (float32, TP [1, 2])" in out.stderr
    missing = _tune("--profile", str(one), "--prefill-tp", "4")
    assert missing.returncode == 2 and "--prefill-tp 4: no profile at that" in missing.stderr
    gpu = dataclasses.replace(make_profile(), tensor_parallel_size=2, device="cuda").save(
        tmp_path / "gpu.json")
    mixed = _tune("--profile", str(one), "--tp-profile", str(gpu))
    assert mixed.returncode == 2 and "measured on cuda" in mixed.stderr


def test_baton_profile_refuses_a_gpu_it_cannot_see():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    out = subprocess.run([sys.executable, "-m", "baton.cli.main", "profile", "--device", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--device cuda: no GPU is visible" in out.stderr


def test_a_rates_simulated_attainment_is_over_its_draws():
    # `baton tune --draws 2` (and the validation's simulated side): the attainment at a rate is
    # the mean over the Poisson arrivals of seeds --seed and --seed+1, as `baton bench --draws`
    # measures it
    from baton.control.tune import Evaluator, Search, TraceSlice, load_trace

    reqs = load_trace(TraceSlice(str(DATA / "azure_llm_2023_conv-head50.csv"), "azure", 40, 0,
                                 0.25, 1024, 64))
    prof = make_profile(per_seq=0.002, attn_decode=1e-5)

    def ev(seed: int, draws: int) -> Evaluator:
        return Evaluator(prof, reqs, Search(0.5, 0.05, 0.9, 1.0, 64.0, None, 3, seed, draws),
                         Knobs())

    layout = Layout(1, 1)
    one = [ev(seed, 1).at(layout, 12.0) for seed in (3, 4)]
    assert one[0] != one[1]  # the two draws differ at this rate: the mean is not one of them
    assert ev(3, 2).at(layout, 12.0) == pytest.approx(sum(one) / 2)
    assert ev(3, 2).at(layout, None) == ev(3, 1).at(layout, None)  # the trace's own times


@pytest.mark.parametrize("flag, value, said", [
    ("--confirm", "0", "--confirm 0: must be >= 1"),
    ("--min-requests", "0", "--min-requests 0: must be >= 1"),
    ("--nice", "20", "--nice 20: must be 0-19"),
])
def test_baton_tune_live_refuses_a_setting_out_of_range_by_name(tmp_path, flag, value, said):
    profile = tmp_path / "profile.json"
    make_profile().save(profile)
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "tune", "--live", "127.0.0.1:9",
         "--redis-url", "redis://127.0.0.1:9", "--profile", str(profile), "--ttft-slo", "4",
         "--tpot-slo", "0.1", flag, value],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and said in out.stderr, out.stderr


def test_baton_tune_live_says_when_the_clusters_redis_does_not_answer(tmp_path):
    """A look whose Redis is down (or restarting) says so and exits 1 (a repeating tuner looks
    again after it), where it ended in a redis-py traceback. Port 9 on loopback: nothing
    listens (the test above's address)."""
    profile = tmp_path / "profile.json"
    make_profile().save(profile)
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "tune", "--live", "127.0.0.1:9",
         "--redis-url", "redis://127.0.0.1:9", "--profile", str(profile), "--ttft-slo", "4",
         "--tpot-slo", "0.1", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    look = json.loads(out.stdout.strip().splitlines()[-1])
    assert look["action"] == "none"
    assert look["reason"].startswith("error: the cluster's Redis did not answer (ConnectionError")
    assert look["reason"].endswith("): switches nothing")
