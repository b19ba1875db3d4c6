"""`baton tune --live`'s decisions (control/tune_live.py): the current layout from the workers'
roles, the fewest switches to reach another in a safe order, and when it acts (the predicted
gain past --min-gain, the last switch older than --min-dwell). The whole loop against a real
cluster is tests/integration/test_tune_live.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from baton.control.sim import Layout
from baton.control.tune_live import (
    Streak,
    assignment,
    best_row,
    current_layout,
    looks_needed,
    next_look_in,
    report,
    steady,
    switches,
    validation_error,
    verdict,
)

from tests.support.profiles import make_profile


def test_the_current_layout_from_the_roles():
    assert current_layout({"a": "prefill", "b": "decode", "c": "decode"}) == Layout(1, 2)
    assert current_layout({"a": "both", "b": "both"}) == Layout(0, 2, colocated=True)
    assert current_layout({"a": "decode", "b": "decode"}) == Layout(0, 2, colocated=True)
    assert current_layout({"a": "prefill", "b": "both"}) is None  # a mix


def test_the_fewest_switches_in_a_safe_order():
    roles = {"a": "prefill", "b": "prefill", "c": "decode"}
    target = assignment(roles, Layout(1, 2))
    assert sorted(target.values()) == ["decode", "decode", "prefill"]
    assert switches(roles, target) == [("b", "decode")]  # one switch, not three
    colo = assignment(roles, Layout(0, 3, colocated=True))
    # every worker a decoder (no prefill pool: each prefills its own requests)
    assert switches(roles, colo) == [("a", "decode"), ("b", "decode")]
    back = {"a": "both", "b": "both", "c": "both"}
    order = switches(back, assignment(back, Layout(2, 1)))
    assert [r for _, r in order] == ["decode", "prefill", "prefill"]  # decoders before


ROWS = [{"layout": "1P+1D", "prefill": 1, "decode": 1, "colocated": False, "goodput_rps": 4.0},
        {"layout": "2 colocated", "prefill": 0, "decode": 2, "colocated": True,
         "goodput_rps": 4.1}]


def test_it_acts_only_past_the_gain_and_the_dwell():
    now = Layout(1, 1)
    small = verdict(ROWS, now, 0.05, 0.0)  # colocated predicted 2.5% better: under 5%
    assert not small.act and "switches nothing" in small.reason
    assert small.best["layout"] == "2 colocated" and math.isclose(small.gain, 0.025)
    big = [dict(ROWS[0]), {**ROWS[1], "goodput_rps": 6.0}]
    go = verdict(big, now, 0.05, 0.0)
    assert go.act and "switch to 2 colocated" in go.reason  # "stay colocated" is an answer
    wait = verdict(big, now, 0.05, 120.0)
    assert not wait.act and "waits 120s" in wait.reason
    stay = verdict(big, Layout(0, 2, colocated=True), 0.05, 0.0)
    assert not stay.act and stay.reason.startswith("stay")
    none = verdict([{**r, "goodput_rps": 0.0} for r in ROWS], now, 0.05, 0.0)
    assert not none.act and "no layout meets the SLOs" in none.reason
    mixed = verdict(big, None, 0.05, 0.0)  # a mix the simulator cannot name: any best is a gain
    assert mixed.act and math.isinf(mixed.gain)


def test_repeating_it_switches_only_when_confirm_looks_in_a_row_want_the_same_switch():
    """Shifting-load run 16 (2026-11-30 00:05): two colocated workers ran the decode-heavy
    phase; the look at 506 s, its window half that phase's backlog and half the lighter
    traffic after it, predicted 1P+1D +60% and switched; the next looks all wanted colocated
    back, and the dwell held the split through most of the last phase (40% of its requests
    met the SLOs, against 57% for colocated held still). With --confirm 2 that one look
    switches nothing."""
    colo, split = Layout(0, 2, colocated=True), Layout(1, 1)
    wants_split = [{**ROWS[0], "goodput_rps": 2.0}, {**ROWS[1], "goodput_rps": 1.25}]
    wants_colo = [{**ROWS[0], "goodput_rps": 0.19}, {**ROWS[1], "goodput_rps": 0.375}]
    streak = Streak()

    def look(rows, now=colo, dwell_left=0.0):
        v = verdict(rows, now, 0.05, dwell_left,
                    streak.agreed(now.name, best_row(rows)["layout"]), confirm=2)
        streak.record(now.name, v, switched=v.act)
        return v

    first = look(wants_split)
    assert first.wants and not first.act and "look 1 of 2 in a row" in first.reason
    assert look(wants_colo).reason.startswith("stay")  # the next look: the row is broken
    again = look(wants_split)
    assert not again.act and "look 1 of 2" in again.reason  # counted from one again
    go = look(wants_split)  # a second look in a row wants the same switch: it goes
    assert go.act and go.reason.startswith("switch to 1P+1D")
    assert streak.count == 0  # a switch made starts the row again
    # the dwell's looks count toward the row, so the first look past it may act
    assert not look(wants_colo, split, dwell_left=60.0).act
    assert look(wants_colo, split).act
    # a look wanting another switch, or one that decided nothing, breaks the row
    look(wants_split)
    streak.reset()
    assert not look(wants_split).act
    # --confirm 1 (and a single look, which no other look could agree with): it acts at once
    assert verdict(wants_split, colo, 0.05, 0.0, 0, confirm=1).act
    # what a look agrees with is its current layout and its best: from another layout, no
    streak.record(split.name, verdict(wants_colo, split, 0.05, 0.0, 0, confirm=2),
                  switched=False)
    assert streak.agreed(split.name, "2 colocated") == 1
    assert streak.agreed(colo.name, "2 colocated") == 0


def _window(shape, start: float, end: float, running_since: float | None = None):
    """The router's window at ``end``: the requests of the shifting-load trace ``shape`` that
    arrived in [start, end), and with ``running_since`` those that arrived since then and
    still run (a backlog: the window holds the requests still running)."""
    from baton.control.workload import Req

    lo = start if running_since is None else running_since
    return [Req([7] * p, o, at) for p, o, at, _ in shape if lo <= at < end]


def test_a_steady_window_needs_one_look_and_one_that_straddles_a_change_needs_confirm():
    """--confirm exists for a window that straddles a change in the traffic (run 16's look at
    506 s, above); a window whose first and last thirds offer the same traffic straddles none,
    and one look switches. On the shifting-load benchmark's own trace (bench/shifting_load.py,
    the phases of every run): its first phase's windows from the first look on (~12-20
    requests), and every 60 s window inside a phase for most seeds, are steady; those that
    straddle a change of phase by 15 s or more, or hold a phase's backlog, are not."""
    from baton.bench.shifting_load import PHASES, trace

    inside = straddling = 0
    for seed in range(5):
        shape = trace(PHASES, 4.0, seed)
        first = next(t for t in range(5, 120, 5) if len(_window(shape, 0, t)) >= 12)
        assert steady(_window(shape, 0, first + 10)), (seed, first)
        for end in range(60, 721, 5):
            w = _window(shape, end - 60, end)
            if not any(end - 60 < b < end for b in (240, 480)):
                inside += bool(steady(w))
            elif any(end - 45 <= b <= end - 15 for b in (240, 480)):
                assert not steady(w), (seed, end)
                straddling += 1
    assert straddling == 5 * 2 * 7 and inside >= 0.9 * 5 * (133 - 2 * 11)
    shape = trace(PHASES, 4.0, 0)
    # run 16's window at 506 s: the decode-heavy phase's backlog (still running since 420 s)
    # and the first 26 s of the prefill-heavy phase after it
    assert not steady(_window(shape, 446, 506, running_since=420))
    # the reason names what agreed
    said = steady(_window(shape, 0, 60))
    assert said.startswith("the window is steady (its first and last thirds: requests ")
    assert "mean prompt" in said and "mean output" in said
    # too few requests in a third to say: not steady
    assert steady(_window(shape, 0, 60)[:6]) == "" and steady([]) == ""
    # a repeating tuner asks --confirm looks of a window that is not steady, one of one that
    # is; a single look (no --every) always one
    calm, moving = _window(shape, 0, 60), _window(shape, 446, 506, running_since=420)
    assert looks_needed(2, True, calm) == (1, steady(calm))
    assert looks_needed(2, True, moving) == (2, "")
    assert looks_needed(3, False, moving) == (1, "")


def test_it_never_switches_to_a_layout_that_serves_the_live_window_worse():
    """The shifting-load run of 2026-11-27 07:06: past a decode-heavy burst, 1P+1D's goodput
    (the Poisson rate it sustains) was predicted 4.0 against colocated's 3.0, yet at the
    window's own arrival times (the burst's backlog) it met the SLOs for 47% of the requests
    against colocated's 94%; the tuner switched, and switched back 90 s later."""
    rows = [{**ROWS[0], "goodput_rps": 4.0, "attainment_live": 0.47},
            {**ROWS[1], "goodput_rps": 3.0, "attainment_live": 0.94}]
    v = verdict(rows, Layout(0, 2, colocated=True), 0.05, 0.0)
    assert not v.act and "would serve the live window worse (47%" in v.reason
    assert v.best["layout"] == "1P+1D" and math.isclose(v.gain, 1 / 3)  # still reported
    rows[0]["attainment_live"] = 0.94  # as good at the live times, better at higher rates
    assert verdict(rows, Layout(0, 2, colocated=True), 0.05, 0.0).act


def test_past_every_layouts_goodput_it_ranks_by_the_share_served_at_the_windows_times():
    """Shifting-load run 24 (2026-12-03 12:51): 0.7 req/s of 1,000-2,000-token prompts on
    1P+1D, past what either layout sustains. The goodput search put both at 0.44-0.63 req/s
    (gains 0% or inside its steps: no switch), while at the window's own arrival times
    colocated served 32-58% of it within the SLOs and 1P+1D 9-52%; colocated held still met
    the SLOs for 4x more of the run's requests. Past every goodput the share ranks."""
    split, colo = Layout(1, 1), Layout(0, 2, colocated=True)
    looks = [  # (1P+1D goodput, its share; colocated's) of the run's second and third looks
        [{**ROWS[0], "goodput_rps": 0.438, "attainment_live": 0.52, "goodput_below_rps": 0.5},
         {**ROWS[1], "goodput_rps": 0.5, "attainment_live": 0.58, "goodput_below_rps": 0.625}],
        [{**ROWS[0], "goodput_rps": 0.5, "attainment_live": 0.11, "goodput_below_rps": 0.625},
         {**ROWS[1], "goodput_rps": 0.5, "attainment_live": 0.32, "goodput_below_rps": 0.625}]]
    # without the window's rate, goodput ranks: inside the steps, then a tie
    assert "within the goodput search's steps" in verdict(looks[0], split, 0.05, 0.0).reason
    assert "under --min-gain" in verdict(looks[1], split, 0.05, 0.0).reason
    streak, said = Streak(), []
    for rows in looks:
        rate = 0.8  # past both goodputs
        v = verdict(rows, split, 0.05, 0.0, streak.agreed(split.name,
                    best_row(rows, rate)["layout"]), confirm=2, rate=rate)
        streak.record(split.name, v, switched=v.act)
        assert v.by == "attainment_live" and v.best["layout"] == "2 colocated"
        said.append(v)
    assert said[0].wants and not said[0].act and "look 1 of 2" in said[0].reason
    assert v.act and v.reason.startswith("switch to 2 colocated")  # the second in a row
    assert "32% of the window within the SLOs against 11% now" in v.reason
    assert "0.8 req/s is past every layout's goodput" in v.reason
    assert math.isclose(v.gain, 0.32 / 0.11 - 1)
    # a rate under one layout's goodput: that layout sustains it, goodput ranks as before
    under = verdict(looks[1], split, 0.05, 0.0, rate=0.45)
    assert under.by == "goodput" and "under --min-gain" in under.reason
    # from the layout that serves the most: it stays, and says why
    stay = verdict(looks[1], colo, 0.05, 0.0, rate=0.8)
    assert stay.reason.startswith("stay: 2 colocated is predicted best (32%")
    # a relative gain of a few requests: 5% against 3% is +67%, but 2 points, under 5
    few = [{**looks[1][0], "attainment_live": 0.03}, {**looks[1][1], "attainment_live": 0.05}]
    assert not verdict(few, split, 0.05, 0.0, rate=0.8).act
    # three layouts: the most goodput named is every layout's, not only the two compared
    third = {**ROWS[0], "layout": "2P+1D", "goodput_rps": 0.7, "attainment_live": 0.05}
    assert "(the most 0.7)" in verdict(looks[1] + [third], split, 0.05, 0.0, rate=0.8).reason
    # none of the window served by any layout: nothing to rank
    zero = [{**r, "attainment_live": 0.0} for r in looks[1]]
    assert "no layout serves any of the window" in verdict(zero, split, 0.05, 0.0,
                                                           rate=0.8).reason
    # a look without the live share (a caller of the goodput rows alone): goodput ranks
    bare = [{k: v for k, v in r.items() if k != "attainment_live"} for r in looks[1]]
    assert verdict(bare, split, 0.05, 0.0, rate=0.8).by == "goodput"


def test_it_never_switches_on_a_gain_inside_the_goodput_search_steps():
    """The shifting-load run of 2026-11-29 11:23: 1P+1D predicted 4.0 req/s against colocated's
    3.5 (+14.3%), but with two bisection steps colocated's search had failed at 4.0 only, so it
    sustains anything under 4.0: the gain could be none. The tuner switched to 1P+1D, and back
    97 s later."""
    from baton.control.workload import find_goodput, lowest_failing

    def searched(top: float) -> tuple[float, float | None]:
        good, points = find_goodput(lambda r: 1.0 if r <= top else 0.0, 0.5, refine=2)
        return good, lowest_failing(points)

    assert searched(3.9) == (3.5, 4.0) and searched(4.2) == (4.0, 5.0)
    assert searched(1e9)[1] is None  # never failed up to --max-rate: no bracket on top
    rows = [{**ROWS[0], "goodput_rps": 4.0, "goodput_below_rps": 5.0},
            {**ROWS[1], "goodput_rps": 3.5, "goodput_below_rps": 4.0}]
    v = verdict(rows, Layout(0, 2, colocated=True), 0.05, 0.0)
    assert not v.act and "within the goodput search's steps" in v.reason
    assert "at least +0.0%" in v.reason and math.isclose(v.gain, 4.0 / 3.5 - 1)
    rows[1]["goodput_below_rps"] = 3.75  # a finer search: colocated under 3.75, +6.7% at least
    assert verdict(rows, Layout(0, 2, colocated=True), 0.05, 0.0).act


def test_a_gain_inside_the_goodput_search_steps_is_searched_finer_until_it_says():
    """Shifting-load runs 24 and 28 held 1P+1D for minutes: look after look the two layouts'
    goodputs shared a step of the search (a tie, 0.0%) or colocated was +14-20% inside its
    steps ("at least +0.0%"), and each such look broke the --confirm row the one before had
    started. A look now bisects the brackets of the current layout and of every layout that
    might be --min-gain over it, 2 steps at a time, up to 4 more, until one surely is or none
    can be. Attainment here is a step at each layout's true goodput: this is the search's
    logic (the simulator's attainment is tests/unit/test_tune.py's)."""
    from baton.control.tune_live import MORE_STEPS, searched_finer, undecided
    from baton.control.workload import find_goodput, lowest_failing

    colo = Layout(0, 2, colocated=True)

    class Steps:  # the attainment of a layout whose true goodput is tops[its name]
        def __init__(self, tops):
            self.tops, self.asked = tops, []

        def at(self, layout, rate):
            self.asked.append((layout.name, rate))
            return 1.0 if rate <= self.tops[layout.name] else 0.0

    def look(tops):  # the look's first search (--refine 2 from 0.5 req/s), and its evaluator
        rows = []
        for row in ROWS:
            good, points = find_goodput(lambda r, n=row["layout"]: 1.0 if r <= tops[n] else 0.0,
                                        0.5, refine=2)
            rows.append({**row, "goodput_rps": good, "goodput_below_rps": lowest_failing(points)})
        return Steps(tops), rows

    # the 2026-11-29 look above: colocated sustains 3.9, 1P+1D 4.2 (+7.7%); the first search
    # has colocated 3.5-4.0 and 1P+1D 4.0-5.0 (inside the steps), two steps more 3.875-4.0
    # and 4.0-4.25 (still), four 3.875-3.906 and 4.1875-4.25: at least +7.2%, it acts
    ev, rows = look({"1P+1D": 4.2, "2 colocated": 3.9})
    assert "within the goodput search's steps" in verdict(rows, colo, 0.05, 0.0).reason
    assert undecided(rows, colo, 0.05) == [rows[1], rows[0]]
    assert searched_finer(rows, colo, 0.05, None, ev, 1, 0.9) == 4 == MORE_STEPS
    assert rows[0]["goodput_rps"] == 4.1875 and rows[1]["goodput_below_rps"] == 3.90625
    assert len(ev.asked) == 8 and undecided(rows, colo, 0.05) == []  # 2 layouts x 4 steps
    assert verdict(rows, colo, 0.05, 0.0).act
    # run 24's ties: both layouts 3.5-4.0 on the first search, 1P+1D truly +7.7%: a tie stays
    # with the current layout, but it is undecided too, and four steps more say it
    ev, rows = look({"1P+1D": 4.2 * 0.93, "2 colocated": 3.9 * 0.93})
    assert rows[0]["goodput_rps"] == rows[1]["goodput_rps"] == 3.5
    assert verdict(rows, colo, 0.05, 0.0).reason.startswith("stay")
    assert searched_finer(rows, colo, 0.05, None, ev, 1, 0.9) == 4
    assert verdict(rows, colo, 0.05, 0.0).act
    # goodputs 1% apart: once the brackets say no layout can be 5% over (both 3.875-4.0 two
    # steps on), it stops, and nothing switches
    ev, rows = look({"1P+1D": 3.94, "2 colocated": 3.9})
    assert searched_finer(rows, colo, 0.05, None, ev, 1, 0.9) == 2
    assert undecided(rows, colo, 0.05) == [] and not verdict(rows, colo, 0.05, 0.0).act
    # decided by the first search, either way: nothing is searched again
    for tops, acts in (({"1P+1D": 4.2, "2 colocated": 2.9}, True),  # surely +33% at least
                       ({"1P+1D": 3.9, "2 colocated": 4.2}, False)):  # 1P+1D under 4.0
        ev, rows = look(tops)
        assert searched_finer(rows, colo, 0.05, None, ev, 1, 0.9) == 0 and ev.asked == []
        assert verdict(rows, colo, 0.05, 0.0).act is acts
    # past every goodput the share served ranks, not goodput: nothing to search
    ev, rows = look({"1P+1D": 4.2, "2 colocated": 3.9})
    assert undecided([{**r, "attainment_live": 0.5} for r in rows], colo, 0.05, rate=9.0) == []

def test_it_looks_again_sooner_while_the_window_fills():
    filling = {"action": "none", "requests": 16, "filling": True, "reason": "under"}
    assert next_look_in(filling, 30.0, 5.0) == 5.0  # the first decision not a whole --every late
    assert next_look_in(filling, 2.0, 5.0) == 2.0  # never later than --every
    for decided in ({"action": "none", "requests": 35, "reason": "stay"},
                    {"action": "switched", "requests": 35, "reason": "switch"},
                    {"action": "none", "reason": "error: the router did not answer"}):
        assert next_look_in(decided, 30.0, 5.0) == 30.0


def test_the_validation_error_on_record(tmp_path):
    assert "no tune validation on record" in validation_error(tmp_path)
    (tmp_path / "tune-validation-20261124T131351Z.json").write_text(json.dumps({
        "predicted": {"d": {"goodput_rps": 3.75}, "c": {"goodput_rps": 2.25}},
        "measured": {"d": {"goodput_rps": 3.75}, "c": {"goodput_rps": 2.5}}}))
    assert "within -10% of measured (" in validation_error(tmp_path)
    (tmp_path / "tune-validation-20261124T141351Z.json").write_text(json.dumps({
        "predicted": {"d": {"goodput_rps": 3.75}, "c": {"goodput_rps": 2.25}},
        "measured": {"d": {"goodput_rps": 3.75}, "c": {"goodput_rps": 2.5}},
        "calibrated": {"d": {"predicted": {"d": {"error": 0.02}, "c": {"error": -0.07}}},
                       "c": {"error": "no measured run with per-request observations"}}}))
    assert ("within -10% of measured, -7% calibrated on a measured run as the live tuner "
            "calibrates"
            in validation_error(tmp_path))


def test_the_live_tuner_simulates_the_workers_tp_size_on_their_device():
    from baton.control.tune_live import pick_profile, worker_groups

    groups = worker_groups({"a": "2 ranks on cpu (pids 10 11)", "b": "2 ranks on cpu (pids 12 13)",
                            "c": ""})
    assert groups == {"a": (2, "cpu"), "b": (2, "cpu"), "c": (1, "")}
    one, two = make_profile(), dataclasses.replace(make_profile(), tensor_parallel_size=2)
    pair = {w: groups[w] for w in ("a", "b")}
    assert pick_profile({1: one, 2: two}, pair) is two
    with pytest.raises(ValueError, match="no profile is at that size"):
        pick_profile({1: one}, pair)
    with pytest.raises(ValueError, match=r"tensor-parallel sizes \[1, 2\]"):
        pick_profile({1: one, 2: two}, groups)
    with pytest.raises(ValueError, match="measured on cpu, the workers run on cuda"):
        pick_profile({1: one}, {"a": (1, "cuda"), "b": (1, "cuda")})
    assert current_layout({"a": "prefill", "b": "decode"}, 2).name == "1P(TP2)+1D(TP2)"


def test_a_refused_switch_keeps_the_ones_made_before_it(client):
    """Workers switch one at a time; when one does not answer, the switches made before it
    stay made and are returned with the refusal (the tuner records them and starts the dwell
    from them), instead of an exception that lost them. Real Redis registry and a real
    WorkerAdmin server on loopback; the second worker's port has nothing listening."""
    import socket

    from baton.control.registry import WorkerRecord, WorkerRegistry
    from baton.control.tune_live import apply
    from baton.services.common.process import make_server
    from baton.services.worker.role import AdminService, RoleGate
    from baton.v1 import worker_pb2_grpc

    gate = RoleGate("prefill")
    server = make_server(max_workers=2)
    worker_pb2_grpc.add_WorkerAdminServicer_to_server(AdminService(gate, "a", lambda: None),
                                                      server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    registry = WorkerRegistry(client)
    for wid, role, p in (("a", "prefill", port), ("b", "decode", closed)):
        registry.put(WorkerRecord(wid, role, f"127.0.0.1:{p}", "f", "i"))
    try:
        said = []
        done, refused = apply(registry, {"a": "decode", "b": "prefill"},
                              {"a": "prefill", "b": "decode"}, 0.0, said.append)
    finally:
        server.stop(None)
    assert done == [("a", "prefill", "decode")] and gate.role == "decode"  # a decoder first
    assert refused.startswith("b: UNAVAILABLE"), refused
    assert said == ["switched a: prefill -> decode"]


def test_the_report_puts_the_windows_measured_attainment_beside_the_simulated_one():
    """A look's text shows what the window's requests met, not only what the simulator says
    they would have: a burst past the current layout's capacity reads "100% (now)" simulated
    when the profile is of a faster machine, and the measured line says otherwise."""
    out = {"current": "1P+1D", "recommended": "1P+1D", "validation": "v", "action": "none",
           "reason": "r", "attainment_measured": 0.25,
           "configurations": [{"layout": "1P+1D", "goodput_rps": 2.0, "attainment_live": 1.0}]}
    text = report(out)
    assert "100% (now)" in text
    assert "measured now: 25% of the window's finished requests met both SLOs" in text
    assert "measured now" not in report({**out, "attainment_measured": None})
    assert "arrived at" not in text  # an older look's output, with no rate
    past = report({**out, "window_rps": 0.8, "ranked_by": "attainment_live"})
    assert "the window arrived at 0.8 req/s; past every layout's goodput: ranked by" in past
    assert "ranked by goodput" in report({**out, "window_rps": 0.8, "ranked_by": "goodput"})


def test_a_look_says_when_the_window_samples_with_filters_the_profile_has_no_cost_for():
    """Sampled requests simulated at greedy's cost are named, not passed over: the look counts
    those that use a filter the profile did not time (a profile from before the sampler was
    timed has none) and the report carries the note."""
    import dataclasses

    from baton.control.tune_live import _sampling_unmeasured
    from baton.control.workload import Req

    reqs = [Req([1], 4), Req([1], 4, 0.0, ("temperature", "top_p")),
            Req([1], 4, 0.0, ("temperature",))]
    old = make_profile()
    note = _sampling_unmeasured(old, reqs)
    assert note.startswith("2 of the window's 3 requests sample with temperature, top_p, which "
                           "the profile has no cost for")
    timed = dataclasses.replace(old, sampling={"temperature": 1e-4, "top_p": 5e-4})
    assert _sampling_unmeasured(timed, reqs) == ""
    assert _sampling_unmeasured(old, [Req([1], 4)]) == ""  # greedy needs none
    out = {"current": "1P+1D", "recommended": "1P+1D", "validation": "v", "action": "none",
           "reason": "r", "sampling_unmeasured": note,
           "configurations": [{"layout": "1P+1D", "goodput_rps": 2.0, "attainment_live": 1.0}]}
    assert f"note: {note}" in report(out)


def test_the_live_tuner_simulates_the_workers_own_engine_settings_at_their_dtype():
    """The simulated engines take the workers' --max-num-seqs and KV pool size from their
    registry entries (a `baton up` worker's pool is often far smaller than the profiling
    run's); workers that differ in one, or a block size other than the profile's, are refused
    by name; older workers that say nothing leave the profile's."""
    from baton.control.registry import WorkerRecord
    from baton.control.tune_live import with_workers_settings

    def rec(wid: str, **kw) -> WorkerRecord:
        return WorkerRecord(wid, "decode", f"127.0.0.1:{len(wid)}", "f", "i", **kw)

    p = make_profile(seqs=64, blocks=10_000)
    got = with_workers_settings(p, [rec("a", max_num_seqs=8, num_blocks=96),
                                    rec("b", max_num_seqs=8, num_blocks=96)])
    assert (got.max_num_seqs, got.num_blocks) == (8, 96)
    assert got.decode == p.decode and got.block_size == p.block_size  # the costs are kept
    # and the simulator runs with them: one slot and one request's blocks serve one at a time
    from baton.control.sim import Layout, simulate

    two = [(32, 8, 0.0), (32, 8, 0.0)]
    alone = with_workers_settings(p, [rec("a", max_num_seqs=1), rec("b", max_num_seqs=1)])
    assert max(r.ttft for r in simulate(Layout(0, 1, True), alone, two)) > \
        max(r.ttft for r in simulate(Layout(0, 1, True), p, two))
    older = with_workers_settings(p, [rec("a"), rec("b")])
    assert (older.max_num_seqs, older.num_blocks) == (64, 10_000)
    with pytest.raises(ValueError, match=r"the workers differ in --max-num-seqs \(8, 16\)"):
        with_workers_settings(p, [rec("a", max_num_seqs=8), rec("b", max_num_seqs=16)])
    with pytest.raises(ValueError, match="measured at --block-size 16, the workers run at 4"):
        with_workers_settings(p, [rec("a", block_size=4), rec("b", block_size=4)])
    # at the profile's dtype (or from workers too old to say) it is taken; at another, refused
    assert with_workers_settings(p, [rec("a", dtype=p.dtype), rec("b")]) == p
    other = "bfloat16" if p.dtype == "float32" else "float32"
    with pytest.raises(ValueError, match=f"measured at --dtype {p.dtype}, the workers run at "
                                         f"{other}: `baton profile --dtype {other}`"):
        with_workers_settings(p, [rec("a", dtype=p.dtype), rec("b", dtype=other)])



def test_the_live_tuner_refuses_a_profile_of_another_model_or_thread_count_by_name():
    """A profile measured on one model (its fingerprint: architecture, weights, dtype, block
    size, KV layout) says nothing of another's costs, nor a profile of one torch thread a
    worker of workers running two: each is refused naming both sides; a profile or worker too
    old to record them is taken as before."""
    import dataclasses

    from baton.control.registry import WorkerRecord
    from baton.control.tune_live import with_workers_settings

    def rec(wid: str, fingerprint: str = "a" * 32, **kw) -> WorkerRecord:
        return WorkerRecord(wid, "decode", f"127.0.0.1:{len(wid)}", fingerprint, "i", **kw)

    p = dataclasses.replace(make_profile(), fingerprint="a" * 32, model_name="SmolLM2-135M")
    same = [rec("a", model="SmolLM2-135M", threads=1), rec("b", model="SmolLM2-135M")]
    assert with_workers_settings(p, same) == p
    with pytest.raises(ValueError, match=r"measured on the model SmolLM2-135M \(fingerprint "
                                         r"aaaaaaaaaaaaaaaa\), the workers serve gemma-3-270m: "
                                         r"`baton profile --model`"):
        with_workers_settings(p, [rec("a", model="SmolLM2-135M"),
                                  rec("b", "b" * 32, model="gemma-3-270m")])
    with pytest.raises(ValueError, match=r"measured at 1 torch thread\(s\) a worker, the "
                                         r"workers run 2: start them with --threads 1 "
                                         r"\(`baton up --threads 1`\), or measure theirs "
                                         r"\(`baton profile --threads 2`\)"):
        with_workers_settings(p, [rec("a", threads=1), rec("b", threads=2)])
    # a profile of their thread count serves them
    two = dataclasses.replace(p, threads=2)
    assert with_workers_settings(two, [rec("a", threads=2), rec("b", threads=2)]) == two
    # on a GPU the threads do not set a step's pace; an older profile cannot be checked
    gpu = dataclasses.replace(p, device="cuda")
    assert with_workers_settings(gpu, [rec("a", threads=2), rec("b", threads=2)]) == gpu
    older = dataclasses.replace(p, fingerprint="", model_name="")
    assert with_workers_settings(older, [rec("a"), rec("b", "b" * 32)]) == older


def test_the_live_tuner_refuses_a_profile_of_another_processor_by_name():
    """A profile's costs are its machine's: the same bfloat16 model ran a 1,024-token prefill
    step in 0.40 s on a 2-vCPU Xeon with AMX and 1.43 s on a 2-vCPU EPYC. Workers register what
    computes for them (the GPU's name, or the CPU's model and speed flags), a profile records
    its machine's, and the tuner refuses a profile of another naming both; a profile from
    before profiles named it is read from its machine's CPU and flags (or GPU), and a worker
    or profile that says nothing is taken as before."""
    import dataclasses

    from baton.control.registry import WorkerRecord
    from baton.control.tune_live import with_workers_settings
    from baton.engine.config import cpu_processor, processor

    def rec(wid: str, **kw) -> WorkerRecord:
        return WorkerRecord(wid, "decode", f"127.0.0.1:{len(wid)}", "f", "i", **kw)

    amd = "AMD EPYC (avx2 avx512f avx512_bf16 fma)"
    intel = "Intel(R) Xeon(R) Processor (avx2 avx512f avx512_bf16 amx_bf16 fma)"
    # a profile of 2026-12-03 (before profiles named their processor) reads as its CPU's
    older = dataclasses.replace(make_profile(), machine={
        "cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f", "avx512_bf16", "fma"]})
    assert older.processor == amd == cpu_processor("AMD EPYC", {"fma", "avx2", "sse4_2",
                                                                "avx512f", "avx512_bf16"})
    assert with_workers_settings(older, [rec("a", processor=amd), rec("b")]) == older
    with pytest.raises(ValueError, match=(
            r"^the profile was measured on AMD EPYC \(avx2 avx512f avx512_bf16 fma\), the "
            r"workers run on Intel\(R\) Xeon\(R\) Processor \(avx2 avx512f avx512_bf16 "
            r"amx_bf16 fma\): `baton profile` on their machine$")):
        with_workers_settings(older, [rec("a", processor=amd), rec("b", processor=intel)])
    # one that names it is read so; a GPU profile from before, by its GPU's name
    named = dataclasses.replace(make_profile(), machine={"cpu": "AMD EPYC", "processor": intel})
    assert with_workers_settings(named, [rec("a", processor=intel)]) == named
    gpu = dataclasses.replace(make_profile(), device="cuda", machine={"gpu": "NVIDIA H200"})
    with pytest.raises(ValueError, match="measured on NVIDIA H200, the workers run on NVIDIA "
                                         "H100 80GB HBM3: "):
        with_workers_settings(gpu, [rec("a", processor="NVIDIA H100 80GB HBM3")])
    # a profile that does not say (a synthetic one) is taken for any workers
    assert make_profile().processor == ""
    assert with_workers_settings(make_profile(), [rec("a", processor=intel)]) == make_profile()
    # this machine's CPU, as its workers register it: its model name from /proc/cpuinfo
    here = processor("cpu")
    with open("/proc/cpuinfo") as f:
        name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    assert here.startswith(f"{name} (")
