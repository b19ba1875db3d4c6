"""The live tuner's calibration (control/calibrate.py): a window measured on a cluster whose
serving factors differ from its profile's is simulated on the layout it ran, and the factors
that reproduce its median TPOT and first-token compute are found again; what it cannot
measure it keeps, and a correction too large to be drift is refused. The "measured" windows
here are the simulator's own on a profile with known factors (the real router's window is
tests/integration/test_tune_live.py)."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest
from baton.control.calibrate import Fits, Observed, calibrate, from_window, served
from baton.control.profile import CostModel
from baton.control.sim import Layout, attainment, simulate
from baton.control.tune import shape
from baton.control.workload import Req, poisson

from tests.support.profiles import make_profile


def window(n: int = 60, rate: float = 2.0, seed: int = 1) -> list[tuple]:
    rng = random.Random(seed)
    reqs = [Req([rng.randrange(5, 500) for _ in range(rng.randint(80, 400))],
                rng.randint(8, 40), 0.0) for _ in range(n)]
    return shape(poisson(reqs, rate, seed))


def scaled(p, kd: float, kp: float):
    return dataclasses.replace(p, serving_factor=p.serving_factor * kd,
                               prefill_factor=p.prefill_factor * kp,
                               prefill_stream_factor=p.prefill_stream_factor * kp)


def mean(obs: list[Observed], key: str) -> float:
    return statistics.fmean(getattr(o, key) for o in obs if getattr(o, key))


def measured(layout, p, sh) -> list[Observed]:
    return [Observed(r.tpot, r.prefill_s, r.path) for r in simulate(layout, p, sh)]


@pytest.mark.parametrize("layout", [Layout(1, 1), Layout(0, 2, True)], ids=lambda x: x.name)
@pytest.mark.parametrize("kd,kp", [(1.2, 1.2), (0.9, 1.15), (1.1, 0.85)])
def test_the_factors_the_window_was_served_at_are_found_again(layout, kd, kp):
    p = make_profile(attn_decode=2e-6, per_seq=5e-4)
    sh = window()
    cal = calibrate(p, layout, sh, measured(layout, scaled(p, kd, kp), sh))
    assert cal.applied, cal.notes
    # two colocated workers run prompts and decodes in the same steps: the two factors trade
    # off a little against each other there
    assert cal.decode_ratio == pytest.approx(kd, rel=0.05)
    assert cal.prefill_ratio == pytest.approx(kp, rel=0.05)
    assert cal.prefill_path == ("remote" if layout.prefill else "local")
    assert cal.profile.serving_factor == pytest.approx(p.serving_factor * cal.decode_ratio)
    if layout.prefill:  # a prefill worker's prompts measured: every prompt's factors
        assert cal.profile.prefill_stream_factor == pytest.approx(
            p.prefill_stream_factor * cal.prefill_ratio)
        assert cal.profile.local_prefill_scale == 1.0
    else:  # the local path's alone: a prefill worker's stay the profile's
        assert cal.profile.prefill_factor == p.prefill_factor
        assert cal.profile.prefill_stream_factor == p.prefill_stream_factor
        assert cal.profile.local_prefill_scale == pytest.approx(cal.prefill_ratio)
        assert "the local path only" in cal.line()
    # the calibrated profile serves the window as it was measured
    again, ref = measured(layout, cal.profile, sh), measured(layout, scaled(p, kd, kp), sh)
    for key in ("tpot_s", "prefill_s"):
        assert mean(again, key) == pytest.approx(mean(ref, key), rel=0.03)


def test_the_decode_factors_are_scaled_together():
    """A profile with its idle and decoding decode factors (version 8): a 1P+1D window served
    with all three 1.2x the profile's is found again, and all three come out scaled."""
    p = dataclasses.replace(make_profile(attn_decode=2e-6, per_seq=5e-4), serving_factor=1.3,
                            serving_factor_idle=1.05, serving_factor_decoding=1.8)
    truth = dataclasses.replace(p, serving_factor=1.3 * 1.2, serving_factor_idle=1.05 * 1.2,
                                serving_factor_decoding=1.8 * 1.2)
    sh, layout = window(), Layout(1, 1)
    cal = calibrate(p, layout, sh, measured(layout, truth, sh))
    assert cal.applied, cal.notes
    assert cal.decode_ratio == pytest.approx(1.2, rel=0.05)
    assert cal.profile.serving_factor_idle == pytest.approx(1.05 * cal.decode_ratio)
    assert cal.profile.serving_factor == pytest.approx(1.3 * cal.decode_ratio)
    assert cal.summary()["serving_factor_idle"] == round(cal.profile.serving_factor_idle, 4)
    assert cal.profile.serving_factor_decoding == pytest.approx(1.8 * cal.decode_ratio)
    assert cal.summary()["serving_factor_decoding"] == round(
        cal.profile.serving_factor_decoding, 4)


def test_a_window_that_matches_changes_nothing():
    p, sh = make_profile(), window()
    cal = calibrate(p, Layout(1, 1), sh, measured(Layout(1, 1), p, sh))
    assert not cal.applied and cal.profile is p and cal.rounds == 1
    assert "none needed" in cal.line()


def test_what_the_window_does_not_measure_is_kept():
    p, sh = make_profile(), window()
    layout = Layout(1, 1)
    obs = [Observed(o.tpot_s, None, o.path) for o in measured(layout, scaled(p, 1.3, 1.0), sh)]
    cal = calibrate(p, layout, sh, obs)
    assert cal.decode_ratio == pytest.approx(1.3, rel=0.03) and cal.prefill_ratio == 1.0
    assert any("prefill factors kept" in n for n in cal.notes)
    # too few finished requests: nothing at all
    few = [o if i < 9 else None for i, o in enumerate(measured(layout, scaled(p, 1.3, 1.3),
                                                               sh))]
    cal = calibrate(p, layout, sh, few)
    assert not cal.applied and cal.profile is p
    assert any("decode factor kept" in n for n in cal.notes)
    with pytest.raises(ValueError, match="observations for"):
        calibrate(p, layout, sh, few[:-1])


def test_a_correction_too_large_for_drift_is_refused():
    p, sh = make_profile(), window()
    layout = Layout(1, 1)
    cal = calibrate(p, layout, sh, measured(layout, scaled(p, 3.0, 3.0), sh))
    assert not cal.applied and cal.profile is p
    assert any("re-run `baton profile`" in n for n in cal.notes), cal.notes


def test_a_colocated_window_leaves_a_prefill_workers_prompts_as_profiled():
    """Fitted on two colocated workers (every prompt prefilled where it decodes), the prefill
    scale reaches the prompts a decode worker prefills, not a prefill worker's: in a 1P+1D
    simulation with the calibrated profile, a long prompt alone costs what the profile says on
    the prefill worker, and a short one the fitted scale on the decode worker."""
    p, sh = make_profile(attn_decode=2e-6, per_seq=5e-4), window()
    colocated = Layout(0, 2, True)
    cal = calibrate(p, colocated, sh, measured(colocated, scaled(p, 1.1, 0.85), sh))
    assert cal.applied and cal.prefill_path == "local"
    assert cal.prefill_ratio == pytest.approx(0.85, rel=0.05)
    cost, fitted = CostModel(p), CostModel(cal.profile)
    assert fitted.step([(300, 0)], []) == pytest.approx(cost.step([(300, 0)], []))
    assert fitted.step([(300, 0)], [], local=True) == pytest.approx(
        cal.prefill_ratio * cost.step([(300, 0)], []))
    done = simulate(Layout(1, 1), cal.profile, [(300, 5, 0.0), (40, 5, 10.0)])
    assert [r.path for r in done] == ["remote", "local"]
    assert done[0].prefill_s == pytest.approx(cost.step([(300, 0)], []))
    assert done[1].prefill_s == pytest.approx(cal.prefill_ratio * cost.step([(40, 0)], []))


def test_the_last_fit_of_each_factor_is_kept_across_looks():
    """The live tuner's looks, as on a machine faster than its profile: a 1P+1D window fits
    the prefill worker's factor; after a switch to colocated, the windows fit the local path's
    and the decode factor, and a prefill worker's prompts keep the 1P+1D window's fit (alone,
    a colocated fit leaves them as profiled); a window that fits nothing (a backlog past the
    tolerance, too few finished requests) changes nothing kept."""
    from baton.control.tune_live import report

    p, sh = make_profile(attn_decode=2e-6, per_seq=5e-4), window()
    cost = CostModel(p)
    one, two = Layout(1, 1), Layout(0, 2, True)
    fits = Fits()
    remote = calibrate(p, one, sh, measured(one, scaled(p, 0.6, 0.55), sh))
    assert remote.applied and remote.prefill_path == "remote"
    fits.update(remote, 0.0)
    truth = dataclasses.replace(scaled(p, 0.7, 1.0), local_prefill_scale=0.6)
    local = calibrate(p, two, sh, measured(two, truth, sh))
    assert local.applied and local.prefill_path == "local"
    assert local.profile.prefill_factor == p.prefill_factor  # this window alone: as profiled
    fits.update(local, 30.0)
    got = fits.profile(p)
    assert got.serving_factor == pytest.approx(p.serving_factor * 0.7, rel=0.05)
    assert got.prefill_factor == pytest.approx(p.prefill_factor * 0.55, rel=0.05)
    assert got.prefill_stream_factor == pytest.approx(p.prefill_stream_factor * 0.55, rel=0.05)
    fitted = CostModel(got)
    assert fitted.step([(300, 0)], []) == pytest.approx(0.55 * cost.step([(300, 0)], []),
                                                        rel=0.05)
    assert fitted.step([(300, 0)], [], local=True) == pytest.approx(
        0.6 * cost.step([(300, 0)], []), rel=0.05)
    before = dataclasses.asdict(fits)
    far = calibrate(p, one, sh, measured(one, scaled(p, 3.0, 3.0), sh))
    few = calibrate(p, two, sh, [o if i < 9 else None
                                 for i, o in enumerate(measured(two, truth, sh))])
    assert far.refused and not few.applied
    fits.update(far, 60.0)
    fits.update(few, 60.0)
    assert dataclasses.asdict(fits) == before
    # the look reports the factors it simulated with, not the refused fit's
    assert far.summary(got)["prefill_factor"] == round(got.prefill_factor, 4)
    assert far.summary()["prefill_factor"] == round(far.profile.prefill_factor, 4)
    kept = fits.summary(60.0)
    assert kept["remote_prefill"]["age_s"] == 60.0 and kept["local_prefill"]["age_s"] == 30.0
    assert kept["decode"]["ratio"] == pytest.approx(0.7, rel=0.05)
    # a fresh Fits is this window's calibration alone
    assert Fits().profile(p) == p
    alone = Fits()
    alone.update(local, 0.0)
    assert alone.profile(p).local_prefill_scale == pytest.approx(local.profile.local_prefill_scale)
    assert alone.profile(p).prefill_factor == p.prefill_factor
    out = {"action": "none", "reason": "stay", "configurations": [], "current": "1P+1D",
           "recommended": "1P+1D", "validation": "", "calibration": {**far.summary(),
                                                                     "kept": kept}}
    text = report(out)
    decode = f"kept from earlier looks: decode x{kept['decode']['ratio']:.3g} (30 s old)"
    assert decode in text, text
    assert "remote prefill x0.5" in text and "(60 s old)" in text, text


def test_a_window_served_below_the_slo_target_changes_no_fit():
    """Near overload the fitted factors follow the queues: a window whose finished requests
    met the SLOs under the target is not fitted at all (the tuner's CPU is the workers'), leaves
    the kept fits as they were, and says so."""
    p, sh = make_profile(attn_decode=2e-6, per_seq=5e-4), window()
    one = Layout(1, 1)
    fits = Fits()
    fitted = []

    def fit(kd: float, kp: float):
        def run():
            fitted.append((kd, kp))
            return calibrate(p, one, sh, measured(one, scaled(p, kd, kp), sh))
        return run

    good = fits.take(fit(0.6, 0.55), 0.0, 0.95, 0.9, p)
    assert good.applied and fits.remote[0] == pytest.approx(0.55, rel=0.05)
    backlog = fits.take(fit(1.2, 1.2), 30.0, 0.4, 0.9, p)
    assert fitted == [(0.6, 0.55)], "a window below the target was fitted"
    assert not backlog.applied and backlog.profile is p and backlog.rounds == 0
    assert "not fitted, the last fits kept" in backlog.notes[-1], backlog.notes
    assert "40%" in backlog.notes[-1] and "90%" in backlog.notes[-1], backlog.notes
    assert fits.remote == (good.prefill_ratio, 0.0) and fits.decode == (good.decode_ratio, 0.0)
    late = fits.take(fit(1.2, 1.2), 60.0, None, 0.9, p)  # too few finished to say: taken
    assert late.applied and fits.remote[1] == 60.0
    assert fits.remote[0] == pytest.approx(1.2, rel=0.05)
    # the router's rows: finished ones only, both SLOs (TPOT absent for one token)
    rows = ([{"ttft_s": 1.0, "tpot_s": 0.05}] * 6 + [{"ttft_s": 5.0, "tpot_s": 0.05}] * 2
            + [{"ttft_s": 1.0, "tpot_s": 0.2}, {"ttft_s": 1.0, "tpot_s": None}]
            + [{"in_flight": True, "ttft_s": None}] * 5)
    assert served(rows, 4.0, 0.1) == pytest.approx(0.7)
    assert served(rows[:9], 4.0, 0.1) is None


def test_the_simulated_first_token_compute_on_each_path():
    p = make_profile()
    cost = CostModel(p)
    long, short = (300, 5, 0.0), (40, 5, 10.0)  # remote, then local (under 64 tokens)
    done = simulate(Layout(1, 1), p, [long, short])
    assert [r.path for r in done] == ["remote", "local"]
    # alone on their workers: the prompt's one step
    assert done[0].prefill_s == pytest.approx(cost.step([(300, 0)], []))
    assert done[1].prefill_s == pytest.approx(cost.step([(40, 0)], []))


def test_the_routers_window_as_observations():
    rows = [{"at": 1.0, "path": "remote", "ttft_s": 0.9, "tpot_s": 0.02,
             "phases": {"admission": 0.0, "decode_wait": 0.1, "route": 0.001,
                        "prefill_queue": 0.2, "prefill": 0.5, "transfer": 0.01}},
            {"at": 2.0, "path": "local", "ttft_s": 0.7, "tpot_s": None,
             "phases": {"admission": 0.1, "decode_wait": 0.2, "route": 0.001,
                        "prefill_queue": 0.1, "prefill": 0.0, "transfer": 0.0}},
            {"at": 3.0, "in_flight": True, "output_tokens": 7}]
    got = from_window(rows)
    assert got[0] == Observed(0.02, 0.5, "remote")
    assert got[1].path == "local" and got[1].tpot_s is None
    assert got[1].prefill_s == pytest.approx(0.299)  # the first token less the waits
    assert got[2] is None


def test_the_validation_predicts_with_the_profile_calibrated_on_one_setups_run():
    """bench/tune_validation.py's calibrated predictions: the run a live tuner would have
    watched (the highest rate at the target attainment), its factors found again, and each
    setup's goodput predicted with them as with the factors it was served at."""
    from baton.bench.tune_validation import calibrated_predictions, calibration_run
    from baton.control.sim import Knobs
    from baton.control.tune import Evaluator, Search
    from baton.control.workload import poisson as cw_poisson

    p = make_profile(attn_decode=2e-6, per_seq=5e-4)
    rng = random.Random(3)
    reqs = [Req([rng.randrange(5, 500) for _ in range(rng.randint(80, 400))],
                rng.randint(8, 40), 0.0) for _ in range(40)]
    search = Search(ttft_slo=2.0, tpot_slo=0.018, attainment=0.9, start_rate=1.0,
                    max_rate=64, min_rate=None, refine=3, seed=0)
    ev = Evaluator(p, reqs, search, Knobs())
    true = Evaluator(scaled(p, 1.15, 1.1), reqs, search, Knobs())
    layouts = {"baton-disaggregated": Layout(1, 1), "baton-colocated": Layout(0, 2, True)}
    runs = []
    for rate in (0.5, 1.0, 2.0, 4.0):  # served at the true factors, as bench/cli.py records
        done = simulate(Layout(1, 1), true.p, shape(cw_poisson(reqs, rate, 0), ev.keys))
        runs.append({"rate": rate, "draw": 0, "attainment": attainment(done, 2.0, 0.018),
                     "observed": [[r.tpot, r.prefill_s, r.path] for r in done]})
    watched = max((r for r in runs if r["attainment"] >= 0.9), key=lambda r: r["rate"])
    assert calibration_run(runs, 0.9) is watched and watched["rate"] > 0.5
    assert calibration_run([{**r, "attainment": 0.1} for r in runs], 0.9)["rate"] == 0.5
    out = calibrated_predictions(ev, layouts, "baton-disaggregated", runs, lambda _: None)
    assert out["rate"] == watched["rate"] and out["applied"]
    assert out["decode_ratio"] == pytest.approx(1.15, rel=0.03)
    assert out["prefill_ratio"] == pytest.approx(1.1, rel=0.03)
    for name, layout in layouts.items():
        want = true.goodput(layout)[0]
        assert ev.goodput(layout)[0] > 1.2 * want  # the profile as measured: optimistic
        assert out["predicted"][name]["goodput_rps"] == pytest.approx(want, rel=0.1)


def validation_slice(tmp_path, seed: int):
    """A stored validation run's parts: its args (a 30-request Azure-format trace written under
    ``tmp_path``), a profile and the evaluator `bench/tune_validation.py` builds from them."""
    from baton.bench.tune_validation import configs, parse_args, slice_args

    trace = tmp_path / "trace.csv"
    rng = random.Random(seed)
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:{i:02d}.0000000,{rng.randint(100, 900)},{rng.randint(8, 40)}\n"
        for i in range(30)))
    a = parse_args(["--trace", str(trace), "--requests", "30", "--scale", "1", "--ttft-slo",
                    "2", "--tpot-slo", "0.02", "--refine", "2"])
    p = make_profile(attn_decode=2e-6, per_seq=5e-4)
    return a, p, configs(a, p, slice_args(a))[1]


def test_stored_validation_runs_are_predicted_again_as_they_were(tmp_path):
    """bench/validation_again.py: a stored run (its args, profile, measured goodputs and fits)
    read back gives the predictions the run stored, while the code that made them is
    unchanged; a fit that applied nothing is left out."""
    import json

    from baton.bench.tune_validation import LAYOUTS, calibrated_predictions
    from baton.bench.validation_again import again

    a, p, ev = validation_slice(tmp_path, seed=5)
    runs = {}
    for name, layout in LAYOUTS.items():  # served at other factors than the profile's
        done = simulate(layout, scaled(p, 1.1, 0.9), shape(poisson(ev.reqs, 1.0, 0), ev.keys))
        runs[name] = [{"rate": 1.0, "draw": 0, "attainment": 1.0,
                       "observed": [[r.tpot, r.prefill_s, r.path] for r in done]}]
    calibrated = {name: calibrated_predictions(ev, LAYOUTS, name, runs[name], lambda _: None)
                  for name in LAYOUTS}
    assert {c["prefill_path"] for c in calibrated.values()} == {"remote", "local"}
    calibrated["baton-colocated-unfitted"] = {**calibrated["baton-colocated"], "applied": False}
    run = tmp_path / "tune-validation-x.json"
    run.write_text(json.dumps({
        "args": vars(a), "profile": dataclasses.asdict(p), "calibrated": calibrated,
        "measured": {name: {"goodput_rps": 1.0} for name in LAYOUTS}}))
    rows = again(run)
    assert len(rows) == 4 and {r["calibrated_on"] for r in rows} == set(LAYOUTS)
    for r in rows:
        assert r["predicted_now_rps"] == r["predicted_then_rps"] > 0
        assert r["error_now"] == pytest.approx(r["predicted_now_rps"] - 1.0)


def test_stored_validation_runs_are_predicted_again_at_their_speed_checks(tmp_path):
    """bench/validation_again.py --speed: a run's speed checks taken before it measured scale
    its profile (an even check gives the run's own predictions; a serving check 1.5x slower
    predicts less, as the profile scaled by hand does); a run with no check gives no rows."""
    import json

    from baton.bench.tune_validation import LAYOUTS
    from baton.bench.validation_again import again, speed_fits
    from baton.control.calibrate import scaled as scaled_as_a_fit

    a, p, ev = validation_slice(tmp_path, seed=6)
    predicted = {name: {"goodput_rps": ev.goodput(layout)[0]} for name, layout in LAYOUTS.items()}
    slower = {name: ev.with_profile(scaled_as_a_fit(p, 1.5, 1.5, "remote")).goodput(layout)[0]
              for name, layout in LAYOUTS.items()}
    assert all(slower[n] < predicted[n]["goodput_rps"] for n in LAYOUTS)
    stored = {"args": vars(a), "profile": dataclasses.asdict(p), "predicted": predicted,
              "measured": {name: {"goodput_rps": 1.0} for name in LAYOUTS}}
    run = tmp_path / "tune-validation-x.json"
    run.write_text(json.dumps({**stored, "machine_speed": {"before": {
        "prefill_ratio": 1.0, "decode_ratio": 1.0,
        "serving": {"prefill_ratio": 1.5, "decode_ratio": 1.5}}}}))
    rows = {(r["calibrated_on"], r["setup"]): r for r in again(run, speed_fits)}
    assert len(rows) == 4
    for name in LAYOUTS:
        even, serving = rows[("engine check", name)], rows[("serving check", name)]
        assert even["predicted_now_rps"] == even["predicted_then_rps"] == \
            predicted[name]["goodput_rps"]
        assert serving["predicted_now_rps"] == slower[name]
        assert serving["error_now"] == pytest.approx(slower[name] - 1.0)
    # a serving check that timed the prefill factor's rise with streaming and the decode grid
    # beside a decoding worker scales those by their own ratios, and the same check as one
    # ratio each (the busy grid's, the lone windows with nothing streamed) is predicted beside
    run.write_text(json.dumps({**stored, "machine_speed": {"before": {"serving": {
        "prefill_ratio": 1.5, "decode_ratio": 1.5, "prefill_stream_ratio": 3.0,
        "prefill_ratio_idle": 1.2, "decode_ratio_decoding": 0.8}}}}))
    rows = {(r["calibrated_on"], r["setup"]): r for r in again(run, speed_fits)}
    assert len(rows) == 4
    for name, layout in LAYOUTS.items():
        rise = ev.with_profile(scaled_as_a_fit(p, 1.5, 1.5, "remote", 3.0, 0.8)
                               ).goodput(layout)[0]
        one = ev.with_profile(scaled_as_a_fit(p, 1.5, 1.2, "remote")).goodput(layout)[0]
        assert rows[("serving check", name)]["predicted_now_rps"] == rise
        assert rows[("serving check", name)]["prefill_stream_ratio"] == 3.0
        assert rows[("serving check", name)]["decode_ratio_decoding"] == 0.8
        assert rows[("serving check, one ratio each", name)]["predicted_now_rps"] == one
    run.write_text(json.dumps(stored))
    assert again(run, speed_fits) == []


def test_stored_runs_are_predicted_again_with_a_decode_factor_rising_with_the_streams(
        tmp_path):
    """bench/validation_again.py --as-measured --stream-slope: a decode step's factor rises by
    the slope for each stream past ``above``, scaled by the neighbours' busy share (none beside
    an idle worker, none at or under ``above``); slope 0 gives the run's own predictions, a
    slope predicts no more than that, and less for some setup."""
    import json

    from baton.bench.tune_validation import LAYOUTS
    from baton.bench.validation_again import again, as_measured, sloped

    a, p, ev = validation_slice(tmp_path, seed=7)
    plain, more = CostModel(p), sloped(p, 0.01, 4)
    ctxs = [100] * 10
    rise = (plain.decode_factor(1.0) + 0.01 * 6) / plain.decode_factor(1.0)
    assert more.step([], ctxs, others_busy=1.0) == pytest.approx(
        plain.step([], ctxs, others_busy=1.0) * rise)
    assert more.step([], ctxs, others_busy=0.5) == pytest.approx(
        plain.step([], ctxs, others_busy=0.5)
        * (plain.decode_factor(0.5) + 0.01 * 6 * 0.5) / plain.decode_factor(0.5))
    assert more.step([], ctxs, others_busy=0.0) == pytest.approx(
        plain.step([], ctxs, others_busy=0.0))
    assert more.step([], [100] * 4) == pytest.approx(plain.step([], [100] * 4))
    predicted = {name: {"goodput_rps": ev.goodput(layout)[0]} for name, layout in LAYOUTS.items()}
    run = tmp_path / "tune-validation-x.json"
    run.write_text(json.dumps({"args": vars(a), "profile": dataclasses.asdict(p),
                               "predicted": predicted,
                               "measured": {name: {"goodput_rps": 1.0} for name in LAYOUTS}}))
    same = {r["setup"]: r for r in again(run, as_measured)}
    assert {n: r["predicted_now_rps"] for n, r in same.items()} == {
        n: v["goodput_rps"] for n, v in predicted.items()}
    slower = {r["setup"]: r for r in again(run, as_measured, 0.2, 0)}
    assert all(r["stream_slope"] == 0.2 and r["above"] == 0 for r in slower.values())
    assert all(slower[n]["predicted_now_rps"] <= same[n]["predicted_now_rps"] for n in LAYOUTS)
    assert any(slower[n]["predicted_now_rps"] < same[n]["predicted_now_rps"] for n in LAYOUTS)
    run.write_text(json.dumps({"args": vars(a), "profile": dataclasses.asdict(p),
                               "predicted": predicted}))  # --skip-measure: nothing to set against
    assert again(run, as_measured) == []


def stored_run(tmp_path, seed: int):
    """A stored run of :func:`validation_slice` with nothing calibrated: its profile, evaluator,
    predictions (the evaluator's) and the file (every setup measured at 1 req/s)."""
    import json

    from baton.bench.tune_validation import LAYOUTS

    a, p, ev = validation_slice(tmp_path, seed)
    predicted = {name: {"goodput_rps": ev.goodput(layout)[0]} for name, layout in LAYOUTS.items()}
    run = tmp_path / "tune-validation-x.json"
    run.write_text(json.dumps({"args": vars(a), "profile": dataclasses.asdict(p),
                               "predicted": predicted,
                               "measured": {name: {"goodput_rps": 1.0} for name in LAYOUTS}}))
    return p, ev, predicted, run


def test_stored_runs_are_predicted_again_with_a_dearer_local_path_or_another_profile(tmp_path):
    """bench/validation_again.py --local-prefill S: the local path's prompts (all of colocated
    workers' prompts) at S times the remote path's predict colocated workers less, and at 1 as
    the run did; --as-measured --profile P: each run predicted with P in place of its own, as
    the evaluator with P predicts it."""
    from baton.bench.tune_validation import LAYOUTS
    from baton.bench.validation_again import again, as_measured
    from baton.control.calibrate import scaled as scaled_as_a_fit

    p, ev, predicted, run = stored_run(tmp_path, seed=8)
    same = {r["setup"]: r["predicted_now_rps"] for r in again(run, as_measured, local_prefill=1)}
    assert same == {n: v["goodput_rps"] for n, v in predicted.items()}
    dear = {r["setup"]: r for r in again(run, as_measured, local_prefill=1.5)}
    assert all(r["local_prefill_scale"] == 1.5 for r in dear.values())
    assert dear["baton-colocated"]["predicted_now_rps"] < same["baton-colocated"]
    other = scaled_as_a_fit(p, 1.5, 1.5, "remote")
    want = {name: ev.with_profile(other).goodput(layout)[0] for name, layout in LAYOUTS.items()}
    got = {r["setup"]: r["predicted_now_rps"]
           for r in again(run, as_measured, profile=dataclasses.asdict(other))}
    assert got == want and all(got[n] < same[n] for n in LAYOUTS)


def test_stored_runs_are_predicted_again_with_a_spread_of_step_times(tmp_path):
    """bench/validation_again.py --step-noise S: each simulated step's time drawn about the
    cost model's (lognormal, mean 1) predicts as the evaluator with that spread does, the same
    each time (fixed draws); at 0 as the run did. (Not always lower: a draw's median is under
    the mean, so a short slice can meet a little more.)"""
    from baton.bench.tune_validation import LAYOUTS
    from baton.bench.validation_again import again, as_measured

    p, ev, predicted, run = stored_run(tmp_path, seed=8)
    same = {r["setup"]: r["predicted_now_rps"] for r in again(run, as_measured, step_noise=0)}
    assert same == {n: v["goodput_rps"] for n, v in predicted.items()}
    spread = {r["setup"]: r for r in again(run, as_measured, step_noise=0.4)}
    assert all(r["step_noise"] == 0.4 for r in spread.values())
    noisy = ev.with_profile(p)
    noisy.cost.step_noise = 0.4
    want = {name: noisy.goodput(layout)[0] for name, layout in LAYOUTS.items()}
    assert {n: r["predicted_now_rps"] for n, r in spread.items()} == want
    assert want != same
    again_ = {r["setup"]: r["predicted_now_rps"] for r in again(run, as_measured, step_noise=0.4)}
    assert again_ == want


@pytest.mark.parametrize("spread", ["0.1,-0.2", "nan", "wide"])
def test_validation_again_refuses_a_spread_that_is_not_a_number_at_least_0(
        spread, monkeypatch, capsys, tmp_path):
    """A negative spread would read as none (every step as the model says): refused by name,
    before any run is read."""
    import sys

    from baton.bench.validation_again import main

    monkeypatch.setattr(sys, "argv", ["validation_again.py", "--as-measured", "--step-noise",
                                      spread, str(tmp_path / "absent.json")])
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == 2
    assert f"--step-noise {spread}: each spread is a number >= 0" in capsys.readouterr().err


def test_a_serving_check_scales_a_profile_and_is_kept_in_it(tmp_path):
    """`baton profile --check P --serving --out NEW`'s profile (calibrate.checked): the decode
    factors scaled by the check's decode ratio and the prefill factors by its prefill ratio,
    as a fit on the remote path scales them; every check kept, oldest first, through a save
    and a load; a ratio that is not a positive number refused."""
    from baton.control.calibrate import checked
    from baton.control.calibrate import scaled as scaled_as_a_fit
    from baton.control.profile import Profile

    p = make_profile(attn_decode=2e-6, per_seq=5e-4)
    once = checked(p, {"decode_ratio": 1.2, "prefill_ratio": 0.9}, "p.json", "t1")
    assert once == dataclasses.replace(scaled_as_a_fit(p, 1.2, 0.9, "remote"), checked=once.checked)
    assert once.serving_factor == pytest.approx(1.2 * p.serving_factor)
    assert once.prefill_factor == pytest.approx(0.9 * p.prefill_factor)
    assert p.checked == []
    twice = Profile.load(checked(once, {"decode_ratio": 0.5, "prefill_ratio": 2.0},
                                 "once.json", "t2").save(tmp_path / "twice.json"))
    assert twice.serving_factor == pytest.approx(0.6 * p.serving_factor)
    assert twice.prefill_factor == pytest.approx(1.8 * p.prefill_factor)
    assert [(c["at"], c["source"]) for c in twice.checked] == [("t1", "p.json"),
                                                                ("t2", "once.json")]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            checked(p, {"decode_ratio": bad, "prefill_ratio": 1.0}, "p.json", "t")
    # a check that timed the prefill factor's rise with streaming scales the rise by its own
    # ratio (kept in the record); the intercept by the prefill ratio
    p.prefill_stream_factor = 0.002
    rise = checked(p, {"decode_ratio": 1.0, "prefill_ratio": 1.1, "prefill_stream_ratio": 2.5},
                   "p.json", "t3")
    assert rise.prefill_factor == pytest.approx(1.1 * p.prefill_factor)
    assert rise.prefill_stream_factor == pytest.approx(2.5 * 0.002)
    assert rise.checked[-1]["prefill_stream_ratio"] == 2.5
    assert "its rise with streaming x2.500" in rise.age()
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="rise"):
            checked(p, {"decode_ratio": 1.0, "prefill_ratio": 1.0, "prefill_stream_ratio": bad},
                    "p.json", "t")
    # and the decode factor beside a decoding worker by the check's ratio there
    p.serving_factor_decoding = 1.3
    dec = checked(p, {"decode_ratio": 1.2, "prefill_ratio": 1.0, "decode_ratio_decoding": 0.9},
                  "p.json", "t4")
    assert dec.serving_factor_decoding == pytest.approx(1.17)
    assert dec.serving_factor == pytest.approx(1.2 * p.serving_factor)
    assert dec.checked[-1]["decode_ratio_decoding"] == 0.9
    assert "decode beside a decoding worker x0.900" in dec.age()
    with pytest.raises(ValueError, match="decoding worker"):
        checked(p, {"decode_ratio": 1.0, "prefill_ratio": 1.0, "decode_ratio_decoding": 0.0},
                "p.json", "t")


def test_a_validation_predicts_with_the_serving_check_beside_the_profile(tmp_path, capsys):
    """bench/tune_validation.py --serving-check: both setups predicted again with the profile
    scaled by the check taken before measuring (a check 1.5x slower predicts what the profile
    scaled by hand predicts, less than the profile as measured), and the report gives that
    column beside the measured goodput with its own error; beside it the band with every prompt
    costing x0.95 and x1.05 of the checked profile (as scaled by hand), the measured goodput
    said inside or outside it."""
    from baton.bench.tune_validation import LAYOUTS, predict_checked, report
    from baton.control.calibrate import scaled as scaled_as_a_fit

    a, p, ev = validation_slice(tmp_path, seed=7)
    predicted = {name: {"layout": layout.name, "goodput_rps": ev.goodput(layout)[0]}
                 for name, layout in LAYOUTS.items()}
    got = predict_checked(ev, p, {"decode_ratio": 1.5, "prefill_ratio": 1.5}, lambda _: None)
    for name, layout in LAYOUTS.items():
        by_hand = ev.with_profile(scaled_as_a_fit(p, 1.5, 1.5, "remote")).goodput(layout)[0]
        assert got[name]["goodput_rps"] == by_hand < predicted[name]["goodput_rps"]
        band = got[name]["prefill_band"]
        for s in ("0.95", "1.05"):
            hand = scaled_as_a_fit(p, 1.5, 1.5 * float(s), "remote")
            assert band[s] == pytest.approx(ev.with_profile(hand).goodput(layout)[0])
        assert band["0.95"] >= by_hand >= band["1.05"]
    # one setup measured inside its band, the other far above it
    inside, outside = "baton-colocated", "baton-disaggregated"
    measured = {inside: {"goodput_rps": got[inside]["goodput_rps"]},
                outside: {"goodput_rps": 100 * got[outside]["prefill_band"]["0.95"]}}
    for m in measured.values():
        m["simulated_at_measured_rates"] = []
    rows = {r["setup"]: r for r in report(a, p, [], predicted, measured, got)["rows"]}
    for name in LAYOUTS:
        m = measured[name]["goodput_rps"]
        assert rows[name]["checked_rps"] == got[name]["goodput_rps"]
        assert rows[name]["checked_error"] == pytest.approx((got[name]["goodput_rps"] - m) / m)
        band = got[name]["prefill_band"]
        assert rows[name]["checked_band_rps"] == [band["1.05"], band["0.95"]]
    assert rows[inside]["measured_in_band"] is True
    assert rows[outside]["measured_in_band"] is False
    out = capsys.readouterr().out
    assert "profile scaled by the serving check" in out
    assert f"{inside}: " in out and "of the checked (reported, not judged), measured inside" in out
    assert "(reported, not judged), measured outside" in out


def test_a_validation_run_is_read_draw_by_draw(tmp_path):
    """bench/validation_draws.py: a stored two-draw run whose log (rates rounded as the run
    prints them) gives every draw's attainment as the simulator does, less 4 points on the
    second: the difference is found draw by draw (mean -2, spread as the draws give it), every
    rate maps to the run's own, and the two draws together give the goodput the simulator's
    search finds where the measured search visited the rates it needs."""
    import json

    from baton.bench.tune_validation import LAYOUTS
    from baton.bench.validation_draws import by_draw, measured_draws

    a, p, ev = validation_slice(tmp_path, seed=7)
    a.draws = 2
    ev.search = dataclasses.replace(ev.search, draws=2)
    layout = LAYOUTS["baton-colocated"]
    predicted, points = ev.goodput(layout)  # the rates the search visits, both draws
    lines = []
    for rate, _ in points:
        for k in (1, 2):
            # draw k arrives as the run drew it: seed + k - 1
            done = simulate(layout, p, shape(poisson(ev.reqs, rate, ev.search.seed + k - 1),
                                             ev.keys))
            att = attainment(done, a.ttft_slo, a.tpot_slo) - (0.04 if k == 2 else 0.0)
            lines.append(f"  baton-colocated {rate:.3g} req/s, draw {k}/2: 30/30 ok, "
                         f"attainment {round(100 * att)}%, TTFT p90 1 ms")
    run = tmp_path / "tune-validation-x.json"
    run.write_text(json.dumps({"args": {**vars(a), "draws": 2},
                               "profile": dataclasses.asdict(p),
                               "measured": {"baton-colocated": {"points": points}}}))
    run.with_suffix(".log").write_text("\n".join(["== baton-colocated", *lines]) + "\n")
    table = measured_draws(run.with_suffix(".log").read_text(),
                           {"baton-colocated": [r for r, _ in points]})
    assert sorted(table["baton-colocated"]) == sorted(r for r, _ in points)
    s = by_draw(run)["setups"]["baton-colocated"]
    assert s["difference_mean"] == pytest.approx(-0.02, abs=0.005)  # the log's rounding
    assert [r["rate"] for r in s["per_rate"]] == sorted(r for r, _ in points)
    both = next(r for r in s["subsets"] if r["draws"] == [1, 2])
    assert both["simulated_rps"] == predicted  # the run's own prediction
    assert [r["draws"] for r in s["subsets"]] == [[1, 2], [1], [2]]
    first = next(r for r in s["subsets"] if r["draws"] == [1])
    assert first["measured_rps"] is None or first["error"] == pytest.approx(
        first["simulated_rps"] / first["measured_rps"] - 1)
    # a run without its log, or of one draw, is refused naming what it lacks
    run.with_suffix(".log").unlink()
    with pytest.raises(SystemExit, match="no log beside it"):
        by_draw(run)
    for args in ({**vars(a), "draws": 1}, {k: v for k, v in vars(a).items() if k != "draws"}):
        run.write_text(json.dumps({"args": args}))  # one draw; a run from before --draws
        with pytest.raises(SystemExit, match="it ran --draws 1"):
            by_draw(run)


def test_a_stored_runs_requests_are_set_beside_the_simulators_account_of_them(tmp_path, capsys,
                                                                           monkeypatch):
    """bench/plateau.py: each measured request beside the simulator's account of the same
    request. Runs "measured" by the simulator itself on the run's profile agree request by
    request (nothing missed in one account only, every ratio 1); runs measured on a profile
    whose prefill costs twice as much miss on their TTFT (1P+1D: on it alone; colocated workers'
    decode steps wait on the prefills too), and every prompt length band
    reads the dearer prefill as measured TTFTs above the simulated."""
    import json

    from baton.bench import plateau
    from baton.bench.plateau import compare, main, simulated_rows, why_missed
    from baton.bench.tune_validation import LAYOUTS
    from baton.control.calibrate import scaled

    a, p, ev = validation_slice(tmp_path, seed=11)
    slow = ev.with_profile(scaled(p, 1.0, 2.0, "remote"))
    rate = 1.0  # both setups near their capacity on the run's profile, past it on the dearer

    def stored(measured_by):
        runs = {name: {"goodput_rps": rate, "runs": [
            {"rate": rate, "draw": 0, "attainment": None,
             "per_request": simulated_rows(measured_by, layout, rate, 0)}]}
            for name, layout in LAYOUTS.items()}
        for m in runs.values():
            (run,) = m["runs"]
            run["attainment"] = sum(why_missed(r, a.ttft_slo, a.tpot_slo) is None
                                    for r in run["per_request"]) / len(run["per_request"])
            for r in run["per_request"]:  # the router's stages, as a measured run keeps them
                r["stages"] = {"wait": 0.0, **r["stages"]}
        path = tmp_path / f"tune-validation-{len(list(tmp_path.glob('tune-*')))}.json"
        path.write_text(json.dumps({"args": vars(a), "profile": dataclasses.asdict(p),
                                    "measured": runs}))
        return path

    same = compare(stored(ev))["setups"]
    for name, layout in LAYOUTS.items():
        (run,) = same[name]["runs"]
        assert run["measured_only_missed"] == run["simulated_only_missed"] == 0
        assert run["attainment"] == run["simulated_attainment"] == ev.at(layout, rate, [0])
        assert all(b["ttft_ratio"] == 1.0 for b in same[name]["bands"].values())
        for x in same[name]["stages"].values():  # request by request: every prefill as simulated
            for group in x["prefill_ratio"].values():
                assert group["requests"] == 0 or group["median"] == group["sum"] == 1.0
            assert all(f["prefill"][0] == f["prefill"][1] for f in x["prefill_furthest"])

    dear = compare(stored(slow))["setups"]
    for name, layout in LAYOUTS.items():
        (run,) = dear[name]["runs"]
        assert run["simulated_attainment"] == ev.at(layout, rate, [0])
        assert run["attainment"] == slow.at(layout, rate, [0]) < run["simulated_attainment"]
        assert run["measured_only_missed"] > 0 and run["simulated_only_missed"] == 0
        late = [m for m in run["measured_only"] if "ttft" in m["why"]]
        assert late and all(m["ttft"] > a.ttft_slo >= m["sim_ttft"] for m in late)
        if name == "baton-disaggregated":  # its decode worker prefills nothing: TTFT alone
            assert {m["why"] for m in run["measured_only"]} == {"ttft"}
        ratios = [b["ttft_ratio"] for b in dear[name]["bands"].values()]
        assert len(ratios) >= 3 and all(r > 1 for r in ratios)
        # a prompt that started at once in both accounts took the dearer profile's time: twice
        alone = [x["prefill_ratio"]["alone"] for x in dear[name]["stages"].values()]
        assert sum(g["requests"] for g in alone) > 0
        assert all(g["median"] == pytest.approx(2.0, rel=0.05) for g in alone if g["requests"])
        for x in dear[name]["stages"].values():  # the furthest off: the longest prompts, slower
            far = x["prefill_furthest"]
            assert far and all(f["prefill"][0] > f["prefill"][1] for f in far)

    # the command: a table and its JSON; a run that kept no request is refused by name
    written = []
    monkeypatch.setattr(plateau, "write_result", lambda name, out: written.append(out) or name)
    assert main([str(stored(slow))]) == 0
    assert "measured-only misses" in capsys.readouterr().out
    assert written[0]["setups"] == dear and "cpus" in written[0]["machine"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"args": vars(a), "profile": dataclasses.asdict(p),
                               "measured": {n: {"goodput_rps": 1.0} for n in LAYOUTS}}))
    with pytest.raises(SystemExit, match="kept no request"):
        main([str(old)])


def test_stored_runs_are_predicted_again_with_dearer_prompts(tmp_path, monkeypatch, capsys):
    """bench/validation_again.py --prefill-scale S: every prompt at S times what the fit left
    (both paths) predicts as the evaluator on the profile with its prefill factors scaled by S,
    lower for both setups; at 1 as the run did. A scale that is not a finite number > 0 is
    refused by name, before any run is read."""
    import sys

    from baton.bench.tune_validation import LAYOUTS
    from baton.bench.validation_again import again, as_measured, main
    from baton.control.calibrate import scaled as scaled_as_a_fit

    p, ev, predicted, run = stored_run(tmp_path, seed=8)
    same = {r["setup"]: r["predicted_now_rps"] for r in again(run, as_measured)}
    assert same == {n: v["goodput_rps"] for n, v in predicted.items()}
    dear = {r["setup"]: r for r in again(run, as_measured, prefill_scale=1.5)}
    assert all(r["prefill_scale"] == 1.5 for r in dear.values())
    other = ev.with_profile(scaled_as_a_fit(p, 1.0, 1.5, "remote"))
    want = {name: other.goodput(layout)[0] for name, layout in LAYOUTS.items()}
    assert {n: r["predicted_now_rps"] for n, r in dear.items()} == want
    assert all(want[n] < same[n] for n in LAYOUTS)
    for bad in ("1,0", "-1", "nan", "inf", "dear"):
        monkeypatch.setattr(sys, "argv", ["validation_again.py", "--as-measured",
                                          "--prefill-scale", bad, str(tmp_path / "absent")])
        with pytest.raises(SystemExit) as stopped:
            main()
        assert stopped.value.code == 2
        said = capsys.readouterr().err
        assert f"--prefill-scale {bad}: each scale is a finite number > 0" in said
