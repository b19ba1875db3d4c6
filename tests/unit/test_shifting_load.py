"""bench/shifting_load.py's rounds: the order setups run in, how rounds are scored, and what
is refused before any setup starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def _res(setup: str, rnd: int, met: int, failed: int = 0, switches: int | None = None) -> dict:
    out = {"setup": setup, "round": rnd, "met_slo": met, "requests": 1572,
           "goodput_rps": met / 720, "failed": failed}
    if switches is not None:
        out["tuner"] = {"switch_count": switches}
    return out


def test_each_round_runs_the_setups_in_the_reverse_order_of_the_one_before():
    from baton.bench.shifting_load import SETUPS, round_order

    assert round_order(list(SETUPS), 1) == [(0, "1P+1D"), (0, "2 colocated"), (0, "live")]
    assert round_order(list(SETUPS), 3) == [
        (0, "1P+1D"), (0, "2 colocated"), (0, "live"),
        (1, "live"), (1, "2 colocated"), (1, "1P+1D"),
        (2, "1P+1D"), (2, "2 colocated"), (2, "live")]


def test_rounds_are_scored_each_on_its_own_and_pooled_over_every_round():
    from baton.bench.shifting_load import pooled, summarize

    one = [_res("1P+1D", 0, 220), _res("2 colocated", 0, 300), _res("live", 0, 285, 0, 1)]
    assert pooled(one, 1) == summarize(one)  # one round: as before rounds existed

    two = one + [_res("live", 1, 310, 1, 2), _res("2 colocated", 1, 290),
                 _res("1P+1D", 1, 200)]
    s = pooled(two, 2)
    r1, r2 = s["rounds"]
    assert r1["best_fixed"] == "2 colocated" and abs(r1["over_best_fixed"] - 285 / 300) < 1e-9
    assert not r1["target_over_best_0_97"] and r1["switches"] == 1
    assert abs(r2["over_best_fixed"] - 310 / 290) < 1e-9 and r2["target_over_best_0_97"]
    assert r2["failed_requests"] == 1 and r2["switches"] == 2
    # pooled: every setup's met requests over both rounds
    assert s["best_fixed"] == "2 colocated" and s["worst_fixed"] == "1P+1D"
    assert abs(s["over_best_fixed"] - 595 / 590) < 1e-9
    assert abs(s["over_worst_fixed"] - 595 / 420) < 1e-9
    assert s["failed_requests"] == 1 and s["switches"] == 3


def test_the_table_names_each_round_and_the_pooled_ratios():
    from baton.bench.shifting_load import pooled, table

    phases = [{"phase": "decode-heavy", "attainment": 0.1}]
    two = [{**x, "attainment": 0.2, "phases": phases}
           for x in (_res("1P+1D", 0, 220), _res("live", 0, 285, 0, 1),
                     _res("live", 1, 310, 0, 1), _res("1P+1D", 1, 200))]
    two[2]["phases"] = [{**phases[0], "errors": {"UNAVAILABLE": 3},
                         "error_details": {"UNAVAILABLE": "UNAVAILABLE: every attempt failed"}}]
    text = table(two, pooled(two, 2))
    assert ("failed, live round 2, decode-heavy: UNAVAILABLE 3; first UNAVAILABLE: "
            "UNAVAILABLE: every attempt failed") in text
    assert text.count("failed, ") == 1  # only where requests failed
    assert "round 1, live tuner: 1.30x the worst fixed layout" in text
    assert "round 2, live tuner: 1.55x" in text
    assert "live tuner, all rounds pooled: 1.42x" in text


def test_a_setup_says_when_the_machine_paused():
    import os
    import signal

    from baton.bench.common import PauseWatch
    from baton.bench.shifting_load import pooled, table

    watch = PauseWatch()  # wake-ups over 2 s late
    assert watch.watching.wait(60), "the watcher never started"
    # the watcher stopped for 4 s, as every process is when the VM pauses
    os.kill(watch.proc.pid, signal.SIGSTOP)
    time.sleep(4)
    os.kill(watch.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while not watch.pauses and time.monotonic() < deadline:
        time.sleep(0.05)
    pauses = watch.stop()
    # this one (a busy machine may add its own)
    ours = [p for p in pauses if 3 <= p["s"] < 60 and 0 <= p["at_s"] < 10]
    assert len(ours) == 1, pauses
    phases = [{"phase": "decode-heavy", "attainment": 0.1}]
    two = [{**_res("1P+1D", 0, 220), "attainment": 0.2, "phases": phases, "pauses": []},
           {**_res("live", 0, 285, 0, 1), "attainment": 0.3, "phases": phases,
            "pauses": pauses}]
    text = table(two, pooled(two, 1))
    assert "machine pauses over 2 s, 1P+1D round 1: none" in text
    assert f"{ours[0]['s']:g} s at {ours[0]['at_s']:g} s" in text.split(
        "machine pauses over 2 s, live round 1: ")[1].splitlines()[0]


def test_a_setup_says_how_many_requests_were_outstanding_and_how_many_waited_for_a_client():
    from baton.bench.loadgen import Record
    from baton.bench.shifting_load import outstanding_peak, table

    def rec(sent, end, late=0.0, error=None):
        r = Record(10, 4, sent, end=end, error=error)
        r.late = late
        return r

    # arrivals at 0, 1, 2 overlap (3 outstanding at 2.5); the one ending at 3 frees its place
    # for the arrival at 3; a failure without an end counts until it was sent (7.5), so the
    # three arrivals after it make 3 again, not 4
    recs = [rec(0, 3), rec(1, 4), rec(2, 5.5, late=1.5), rec(3, 6), rec(7, None, 0.5, "X"),
            rec(7.6, 9), rec(7.7, 9), rec(7.8, 9)]
    assert outstanding_peak(recs) == 3
    assert outstanding_peak(recs[:4] + [rec(7, None, 2.0, "X")] + recs[5:]) == 4
    assert outstanding_peak([]) == 0
    row = {**_res("live", 0, 285, 0, 1), "attainment": 0.2, "phases": [],
           "outstanding_peak": 3, "late_over_1s": 1}
    assert ("clients, live round 1: at most 3 requests outstanding; 1 waited over 1 s for a "
            "client" in table([row], {"failed_requests": 0}))


def test_a_run_stopped_part_way_writes_and_scores_the_rounds_every_setup_finished(
        capsys, monkeypatch):
    """Ctrl-C, or SIGTERM (turned into it), during a setup: that setup's processes stop (its
    own cleanup), the setups that finished are written, and the ratios score only the rounds
    every setup finished; stopped before any finished, nothing is written. SIGTERM's handler
    is the caller's again afterwards."""
    import signal

    import baton.engine.config
    from baton.bench import shifting_load
    from baton.bench.common import RESULTS

    monkeypatch.setattr(baton.engine.config, "processor",
                        lambda device: "AMD EPYC (avx2 avx512f avx512_bf16 fma)")
    written = []
    monkeypatch.setattr(shifting_load, "write_result",
                        lambda name, out: written.append(out) or RESULTS / "not-written.json")
    met = {"1P+1D": 220, "2 colocated": 300, "live": 290}
    calls = []

    def run_setup(a, name, shape, phases):
        calls.append(name)
        if len(calls) == stop_at:
            signal.raise_signal(signal.SIGTERM)  # as `timeout` or `kill` sends it
            raise AssertionError("SIGTERM did not stop the setup")
        phase = {"phase": "prefill-heavy", "attainment": 0.5, "met_slo": met[name],
                 "tpot_s": None}
        return {**_res(name, 0, met[name]), "attainment": 0.2, "phases": [phase]}

    monkeypatch.setattr(shifting_load, "run_setup", run_setup)
    argv = ["--minutes", "1", "--no-speed-check", "--rounds", "2",
            "--profile", str(RESULTS / "tune-validation-profile-v8-20261202.json")]
    mine = signal.getsignal(signal.SIGTERM)
    stop_at = 5  # round 2's second setup (live, then 2 colocated)
    assert shifting_load.main(argv) == 130
    assert signal.getsignal(signal.SIGTERM) is mine
    (out,) = written
    assert out["stopped"] == {"during": "2 colocated round 2", "rounds_scored": 1}
    assert [(r["setup"], r["round"]) for r in out["results"]] == [
        ("1P+1D", 0), ("2 colocated", 0), ("live", 0), ("live", 1)]
    assert out["summary"] == shifting_load.summarize(out["results"][:3])
    assert out["summary"]["over_best_fixed"] == 290 / 300
    captured = capsys.readouterr()
    assert "stopped during 2 colocated round 2" in captured.err
    assert ("stopped during 2 colocated round 2: the ratios score the 1 round(s) every setup "
            "finished") in captured.out
    assert "0.97x the best (2 colocated" in captured.out

    calls.clear()
    written.clear()
    stop_at = 1
    assert shifting_load.main(argv) == 130
    assert written == [] and signal.getsignal(signal.SIGTERM) is mine
    assert "stopped during 1P+1D round 1\nno setup had finished: nothing written" in (
        capsys.readouterr().err)


def test_a_validation_stopped_while_measuring_writes_nothing_and_exits_130(capsys, monkeypatch):
    """bench/tune_validation.py takes SIGTERM as Ctrl-C while it measures, so the running
    step's cleanup stops its processes (the default action left its workers running), writes
    nothing, exits 130, and gives SIGTERM's handler back."""
    import signal

    import baton.bench.profile
    import baton.engine.config
    from baton.bench import tune_validation
    from baton.bench.common import RESULTS

    monkeypatch.setattr(baton.engine.config, "processor",
                        lambda device: "AMD EPYC (avx2 avx512f avx512_bf16 fma)")
    monkeypatch.setattr(tune_validation, "write_result",
                        lambda *a: pytest.fail("a stopped validation wrote a result"))

    def speed_probe(*a, **kw):
        signal.raise_signal(signal.SIGTERM)  # as `timeout` or `kill` sends it
        raise AssertionError("SIGTERM did not stop the measuring")

    monkeypatch.setattr(baton.bench.profile, "speed_probe", speed_probe)
    mine = signal.getsignal(signal.SIGTERM)
    data = Path(__file__).resolve().parent.parent / "data"
    assert tune_validation.main([
        "--profile", str(RESULTS / "tune-validation-profile-v8-20261202.json"), "--dtype",
        "bfloat16", "--trace", str(data / "azure_llm_2023_conv-head50.csv"), "--requests",
        "8", "--refine", "1"]) == 130
    assert signal.getsignal(signal.SIGTERM) is mine
    assert "stopped while measuring: nothing written" in capsys.readouterr().out


def test_a_setting_it_cannot_run_is_refused_by_name_before_any_setup_starts(capsys, tmp_path):
    from baton.bench.shifting_load import main

    assert main(["--rounds", "0"]) == 2
    assert "--rounds 0: must be >= 1" in capsys.readouterr().err
    assert main(["--clients", "0"]) == 2
    assert "--clients 0: must be >= 1" in capsys.readouterr().err
    # the speed check reads the profile even with no tuner among the setups
    missing = tmp_path / "none.json"
    assert main(["--only", "1P+1D", "--profile", str(missing)]) == 2
    assert f"--profile {missing}: no such file" in capsys.readouterr().err
    assert main(["--only", "1P+1D,3P"]) == 2
    assert "unknown setup(s) ['3P']" in capsys.readouterr().err
    # a profile the simulator cannot read is refused before the first setup, not after the run
    old = tmp_path / "old.json"
    old.write_text('{"version": 2}')
    assert main(["--only", "1P+1D", "--profile", str(old)]) == 2
    assert f"--profile {old}: profile {old} has version 2" in capsys.readouterr().err


def test_the_simulator_replays_the_trace_for_each_fixed_layout_and_a_written_run(
        capsys, tmp_path):
    import argparse
    import json

    from baton.bench.common import RESULTS
    from baton.bench.shifting_load import Phase, main, simulated, trace

    profile = str(RESULTS / "tune-validation-profile.json")
    # a light phase every layout serves within the SLOs, then one that overloads them
    phases = [Phase("light", (64, 128), (8, 16), 0.2), Phase("flood", (64, 256), (128, 256), 20)]
    shape = trace(phases, 0.5, 0)
    sim = simulated(argparse.Namespace(profile=profile, minutes=0.5, ttft_slo=4.0, tpot_slo=0.1),
                    shape, phases)
    assert set(sim["layouts"]) == {"1P+1D", "2 colocated"}
    for s in sim["layouts"].values():
        light, flood = s["phases"]
        assert light["requests"] + flood["requests"] == len(shape)
        assert light["met_slo"] == light["requests"] > 0
        assert flood["met_slo"] < flood["requests"] / 2
        assert s["met_slo"] == light["met_slo"] + flood["met_slo"]

    # --replay: a written run's measured rounds beside the simulator's, on the run's own trace
    measured = [{"setup": "2 colocated", "round": r, "met_slo": met, "requests": len(shape),
                 "phases": [{"met_slo": met - 5}, {"met_slo": 5, "tpot_s": {"p50": 0.15}}]}
                for r, met in ((0, 40), (1, 20))]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"args": {"minutes": 0.5, "seed": 0, "ttft_slo": 4.0,
                                        "tpot_slo": 0.1},
                               "phases": [vars(p) for p in phases], "results": measured}))
    assert main(["--replay", str(run), "--profile", profile]) == 0
    lines = [" ".join(x.split()) for x in capsys.readouterr().out.splitlines()]
    s = sim["layouts"]["2 colocated"]
    met = s["met_slo"]
    assert (f"2 colocated simulated {met} ({s['phases'][0]['met_slo']} / "
            f"{s['phases'][1]['met_slo']}) TPOT") in "\n".join(lines)
    assert (f"2 colocated round 2 20 (15 / 5) TPOT - / 150 (simulated "
            f"{100 * (met / 20 - 1):+.0f}%)") in lines

    # a run made from other phases or another seed is refused, as is a file that is no run
    run.write_text(json.dumps({"args": {"minutes": 0.5, "seed": 1, "ttft_slo": 4.0,
                                        "tpot_slo": 0.1},
                               "phases": [vars(p) for p in phases],
                               "results": [{**measured[0], "requests": len(shape) + 1}]}))
    assert main(["--replay", str(run), "--profile", profile]) == 2
    assert f"its trace had {len(shape) + 1} requests" in capsys.readouterr().err
    run.write_text("{}")
    assert main(["--replay", str(run), "--profile", profile]) == 2
    assert "not a shifting-load result (KeyError" in capsys.readouterr().err


def test_a_trace_the_profiles_machine_cannot_serve_is_refused_before_any_setup_starts(
        capsys, monkeypatch, tmp_path):
    """On its own profile the slower VM kind of 2026-12-02 serves no fixed layout within the
    SLOs (its run of the full trace: 1, 6 and 1 met of 1,572, an hour): refused unless
    --anyway; a faster machine's profile passes to the setups."""
    from baton.bench import shifting_load
    from baton.bench.common import RESULTS

    class Started(Exception):
        pass

    def run_setup(a, name, *rest):
        raise Started(name)

    monkeypatch.setattr(shifting_load, "run_setup", run_setup)
    slow = RESULTS / "tune-validation-profile-v8-20261202T1040.json"
    fast = RESULTS / "tune-validation-profile-v8-20261202.json"
    base = ["--minutes", "1", "--no-speed-check"]
    # both measured on the AMD VMs: a machine of another processor is refused first, naming
    # both (the live setup's tuner would refuse the profile at every look)
    import baton.engine.config

    intel = "Intel(R) Xeon(R) Processor (avx2 avx512f avx512_bf16 amx_bf16 fma)"
    monkeypatch.setattr(baton.engine.config, "processor", lambda device: intel)
    assert shifting_load.main([*base, "--profile", str(fast)]) == 2
    assert (f"--profile {fast}: measured on AMD EPYC (avx2 avx512f avx512_bf16 fma), this "
            f"machine is {intel}; `baton profile` here: the live tuner refuses a profile of "
            "another machine") in capsys.readouterr().err
    from baton.bench import tune_validation  # and the simulator's validation

    a = tune_validation.parse_args(["--profile", str(fast), "--dtype", "bfloat16"])
    with pytest.raises(SystemExit, match=f"--profile {fast} was measured on AMD EPYC "):
        tune_validation.load_profile(a)
    monkeypatch.setattr(baton.engine.config, "processor",
                        lambda device: "AMD EPYC (avx2 avx512f avx512_bf16 fma)")
    assert shifting_load.main([*base, "--profile", str(slow)]) == 2
    err = capsys.readouterr().err
    assert (f"--profile {slow}'s costs no fixed layout meets both SLOs for 20 of the trace's "
            "387 requests (1P+1D 1, 2 colocated 8)") in err
    assert "--anyway" in err
    with pytest.raises(Started, match="1P"):
        shifting_load.main([*base, "--profile", str(slow), "--anyway"])
    with pytest.raises(Started, match="1P"):  # 26 and 29 met: it runs
        shifting_load.main([*base, "--profile", str(fast)])
    # a profile of another dtype than the setups' workers: refused before the simulator runs
    capsys.readouterr()
    assert shifting_load.main([*base, "--profile", str(fast), "--dtype", "float32"]) == 2
    assert ("measured at --dtype bfloat16, the setups' workers run at --dtype float32"
            in capsys.readouterr().err)
    # and of another thread count than theirs (one each): refused too, by its flag
    import dataclasses

    from baton.control.profile import Profile

    two = dataclasses.replace(Profile.load(fast), threads=2).save(tmp_path / "two.json")
    assert shifting_load.main([*base, "--profile", str(two)]) == 2
    assert ("measured at --threads 2, the setups' workers run one torch thread each"
            in capsys.readouterr().err)
    # bench/tune_validation.py and bench/sim_check.py read their profile the same way
    a = tune_validation.parse_args(["--profile", str(two), "--dtype", "bfloat16"])
    with pytest.raises(SystemExit, match="measured at --threads 2, the setups' workers run "
                                         "one torch thread each"):
        tune_validation.load_profile(a)
    a = tune_validation.parse_args(["--profile", str(fast), "--dtype", "float32"])
    with pytest.raises(SystemExit, match="measured at --dtype bfloat16"):
        tune_validation.load_profile(a)


def test_a_setup_counts_the_paths_its_requests_took():
    from baton.bench.loadgen import Record
    from baton.bench.shifting_load import path_counts, pooled, table

    recs = []
    for path, error in (("remote", None), ("local", None), ("migrated", None),
                        ("remote", None), (None, "UNAVAILABLE")):
        r = Record(10, 4, 0.0, end=1.0, error=error)
        r.path = path
        recs.append(r)
    counts = path_counts(recs)
    assert counts == {"local": 1, "migrated": 1, "remote": 2}  # failed ones not counted
    res = [{**_res("live", 0, 285, 0, 1), "attainment": 0.3, "paths": counts,
            "phases": [{"phase": "decode-heavy", "attainment": 0.1}]}]
    assert "paths, live round 1: local 1, migrated 1, remote 2" in table(res, pooled(res, 1))
