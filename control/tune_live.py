"""``baton tune --live ROUTER [--apply]``: the tuner on the live cluster.

It reads the router's live workload (``/v1/baton/workload``: the requests of its last
``--workload-window`` seconds, lengths and times only) and the registered workers, simulates
every layout of those workers (each prefill:decode split, and all colocated) on that workload
with `baton profile`'s costs, and recommends one with its predicted goodput and the error the
last validation measured (``bench/tune_validation.py``). It first calibrates the profile on
the window (control/calibrate.py: the serving factors that make the layout the workers run now,
simulated on the window's arrivals, give its measured TPOT and first-token compute;
``--no-calibrate``: the profile as measured); with ``--every`` each factor a window cannot fit
(too few finished requests, or no prefill pool to say what a prefill worker costs) keeps its
last fit (``calibrate.Fits``), and a window served below the SLO target (near overload the fit
follows the queues) is not fitted and changes no fit. With
``--apply`` it switches roles to get there, one worker at a time (``WorkerAdmin.SetRole``, as
`baton role`; the ones that gain decoding first, so the cluster never lacks a decoder), but only
when the predicted gain is at least ``--min-gain`` (default 5%), even from the top of the current
layout's goodput bracket (the search brackets each goodput between a rate that met the SLOs and
the lowest that failed), the last switch is at least ``--min-dwell`` seconds old (kept in
Redis, so separate runs do not flap), and, with ``--every``, ``--confirm`` looks in a row
(default 2) wanted the same switch: one window that straddles a change in the traffic (a
decode-heavy burst's backlog and the lighter traffic after it) must not switch on its own;
a steady window (:func:`steady`: its first and last thirds offer the same traffic)
straddles no change, so it switches on one look.
When the window arrives faster than every layout's goodput (each layout is past what it
sustains, and goodput, the highest rate served at the attainment target, no longer tells them
apart), the layouts are ranked instead by the share of the window's requests each is
simulated to serve within both SLOs at the window's own arrival times, and a switch needs
that share --min-gain higher, relatively and in points.
``--every S`` repeats it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from baton.control.sim import Layout
from baton.control.tune import arrival_rate, overloaded, ranked_best
from baton.control.workload import lowest_failing

LAST_APPLY = "baton:tune:last_apply"  # Redis: unix time of the last switch --apply made
# a look whose goodput brackets leave the switch open (undecided) searches further, up to
# this many more bisections (2 at a time) of the current layout's bracket and of those that
# might be --min-gain over it: shifting-load runs 24 and 28 held 1P+1D for minutes on looks
# whose goodputs tied in one step or differed inside the steps ("at least +0.0%"), each
# breaking the --confirm row the look before had started
MORE_STEPS = 4
# a window is steady when its first and last thirds (by arrival time) agree on the requests
# that arrived (within STEADY_COUNT_WITHIN: a Poisson stream's thirds of 4-8 requests can
# differ 2x) and on their mean prompt and mean output tokens (within STEADY_MEAN_WITHIN). On
# the shifting-load benchmark's trace (its phases move the rate 7x, the prompts 9x, the
# outputs 5x; 40 seeds, a 60 s window every 5 s) 98% of the windows inside one phase are
# steady, and 8% of those that straddle a change by 5 s or more, all of them 83% or more of one
# phase (a look on one of those decides for the phase that fills it, one look sooner than
# --confirm would have let it)
STEADY_COUNT_WITHIN = 2.5
STEADY_MEAN_WITHIN = 1.5
STEADY_LEAST = 4  # requests in each third, fewer: not called steady


def current_layout(roles: dict[str, str], tp: int = 1) -> Layout | None:
    """The layout the workers' roles form, each worker ``tp`` ranks (None: a mix with ``both``
    the simulator has no name for)."""
    vals = list(roles.values())
    n = len(vals)
    if all(v == "both" for v in vals) or vals.count("prefill") == 0:
        return Layout(0, n, True, tp, tp)  # no prefill pool: every worker prefills its own
    if "both" in vals:
        return None
    return Layout(vals.count("prefill"), vals.count("decode"), False, tp, tp)


def assignment(roles: dict[str, str], layout: Layout) -> dict[str, str]:
    """Each worker's role in ``layout``, changing as few workers as possible. Colocated is every
    worker a decoder with no prefill pool: the router then prefills each request where it
    decodes (the simulator's colocated layout, and `baton bench compare`'s). All ``both`` would
    not be: the router prefills a long prompt on another ``both`` worker and hands it over."""
    ids = sorted(roles)
    if layout.colocated:
        return {w: "decode" for w in ids}
    want = {"prefill": layout.prefill, "decode": layout.decode}
    target: dict[str, str] = {}
    for w in ids:
        r = roles[w]
        if want.get(r, 0) > 0:
            target[w] = r
            want[r] -= 1
    for w in ids:
        if w not in target:
            r = "decode" if want["decode"] > 0 else "prefill"
            target[w] = r
            want[r] -= 1
    return target


def switches(roles: dict[str, str], target: dict[str, str]) -> list[tuple[str, str]]:
    """(worker, role) to switch, in a safe order: those that start decoding before those that
    stop, so at every step some worker decodes."""
    changed = [(w, r) for w, r in sorted(target.items()) if roles[w] != r]
    return sorted(changed, key=lambda wr: wr[1] == "prefill")


@dataclass(frozen=True)
class Verdict:
    best: dict  # the recommended row
    current: dict | None  # the current layout's row (None: a mix the simulator has no name for)
    gain: float  # best over current, minus 1, in ``by`` (inf: current meets none)
    act: bool  # --apply would switch now
    reason: str
    wants: bool = False  # every check passed but the dwell and --confirm: this look agrees
    by: str = "goodput"  # what ranked the layouts: "goodput", or "attainment_live" (overloaded)


def best_row(rows: list[dict], rate: float | None = None) -> dict:
    """The layout with the highest predicted goodput; past every layout's goodput
    (:func:`~baton.control.tune.overloaded`), the highest share of the window served within
    the SLOs at its own arrival times. Ties: the higher goodput, then colocated."""
    return ranked_best(rows, rate, "attainment_live")


def verdict(rows: list[dict], current: Layout | None, min_gain: float,
            dwell_left: float, agreed: int = 0, confirm: int = 1,
            rate: float | None = None) -> Verdict:
    """The look's decision on the simulated ``rows``. ``agreed``: how many looks in a row before
    this one wanted the same switch (:class:`Streak`); it acts only at the ``confirm``-th.
    ``rate``: the window's arrival rate (:func:`~baton.control.tune.arrival_rate`; None:
    goodput ranks always)."""
    best = best_row(rows, rate)
    cur = next((r for r in rows if current is not None and r["layout"] == current.name), None)
    if overloaded(rows, rate, "attainment_live"):
        top = max(r["goodput_rps"] for r in rows)
        return _overloaded_verdict(best, cur, rate, top, min_gain, dwell_left, agreed, confirm)
    if cur is best:
        return Verdict(best, cur, 0.0, False, f"stay: {best['layout']} is predicted best")
    if best["goodput_rps"] <= 0:
        return Verdict(best, cur, 0.0, False, "no layout meets the SLOs at any rate searched: "
                       "switches nothing")
    base = cur["goodput_rps"] if cur is not None else 0.0
    gain = best["goodput_rps"] / base - 1 if base > 0 else math.inf
    if gain < min_gain:
        return Verdict(best, cur, gain, False, f"predicted gain {100 * gain:.1f}% is under "
                       f"--min-gain {100 * min_gain:.0f}%: switches nothing")
    # the search brackets each goodput between a rate that met the SLOs and the lowest that
    # failed: a gain inside the brackets is the search's rounding, not a prediction
    ceiling = cur.get("goodput_below_rps") if cur is not None else None
    floor = best["goodput_rps"] / ceiling - 1 if ceiling else math.inf
    if floor < min_gain:
        return Verdict(best, cur, gain, False, f"predicted gain {100 * gain:.1f}% is within "
                       f"the goodput search's steps ({cur['layout']} under {ceiling:.3g} req/s, "
                       f"{best['layout']} at least {best['goodput_rps']:.3g}: at least "
                       f"{100 * floor:+.1f}%, under --min-gain {100 * min_gain:.0f}%): switches "
                       "nothing (--refine narrows the steps)")
    live, now = best.get("attainment_live"), cur.get("attainment_live") if cur else None
    if live is not None and now is not None and live < now:
        # its goodput (the highest Poisson rate it sustains) is higher, but at the window's
        # own arrival times (a backlog, a burst) it serves fewer requests than the layout now
        return Verdict(best, cur, gain, False, f"{best['layout']} would serve the live window "
                       f"worse ({100 * live:.0f}% meeting the SLOs at its own arrival times, "
                       f"against {100 * now:.0f}% now): switches nothing")
    said = f"{'+inf' if math.isinf(gain) else f'+{100 * gain:.1f}'}% goodput"
    return _wanted(best, cur, gain, said, dwell_left, agreed, confirm, "goodput")


def _overloaded_verdict(best: dict, cur: dict | None, rate: float, top: float,
                        min_gain: float, dwell_left: float, agreed: int,
                        confirm: int) -> Verdict:
    """:func:`verdict` past every layout's goodput (the highest ``top``): the layouts ranked by
    the share of the window each serves within the SLOs at its own arrival times."""
    by = "attainment_live"
    past = (f"the window's {rate:.3g} req/s is past every layout's goodput (the most "
            f"{top:.3g}): ranked by the share of the window served within the SLOs at its own "
            "times")
    live = best["attainment_live"]
    if cur is best:
        return Verdict(best, cur, 0.0, False, f"stay: {best['layout']} is predicted best "
                       f"({100 * live:.0f}%; {past})", by=by)
    if live <= 0:
        return Verdict(best, cur, 0.0, False, f"no layout serves any of the window within the "
                       f"SLOs ({past}): switches nothing", by=by)
    now = cur["attainment_live"] if cur is not None else 0.0
    gain = live / now - 1 if now > 0 else math.inf
    # a relative gain on a small share can be a request or two of the window: the points too
    if gain < min_gain or live - now < min_gain:
        return Verdict(best, cur, gain, False, f"{best['layout']} would serve {100 * live:.0f}% "
                       f"of the window within the SLOs against {100 * now:.0f}% now, under "
                       f"--min-gain {100 * min_gain:.0f}% more ({past}): switches nothing",
                       by=by)
    said = (f"{100 * live:.0f}% of the window within the SLOs against {100 * now:.0f}% now; "
            f"{past}")
    return _wanted(best, cur, gain, said, dwell_left, agreed, confirm, by)


def _wanted(best: dict, cur: dict | None, gain: float, said: str, dwell_left: float,
            agreed: int, confirm: int, by: str) -> Verdict:
    """A switch every check wants: made now, or held by the dwell or by ``--confirm``."""
    if dwell_left > 0:
        return Verdict(best, cur, gain, False, f"the last switch was too recent: waits "
                       f"{dwell_left:.0f}s more (--min-dwell)", wants=True, by=by)
    if agreed + 1 < confirm:
        return Verdict(best, cur, gain, False, f"{best['layout']} predicted {said}: look "
                       f"{agreed + 1} of {confirm} in a row that must want it before a switch "
                       "(--confirm)", wants=True, by=by)
    return Verdict(best, cur, gain, True, f"switch to {best['layout']} (predicted {said})",
                   wants=True, by=by)


def steady(reqs) -> str:
    """Why the window's traffic did not change within it ("" when it did, or when too few
    requests say): its first and last thirds by arrival time agree on their requests (within
    :data:`STEADY_COUNT_WITHIN`), mean prompt and mean output tokens (within
    :data:`STEADY_MEAN_WITHIN`). ``--confirm`` guards against a window that straddles a change
    of traffic; a steady window straddles none, so one look switches (a cluster that starts in
    the wrong layout for steady traffic switches a look sooner: the shifting-load benchmark's
    first phase)."""
    if not reqs:
        return ""
    at = [r.at for r in reqs]
    lo, hi = min(at), max(at)
    third = (hi - lo) / 3
    first = [r for r in reqs if r.at < lo + third]
    last = [r for r in reqs if r.at >= hi - third]
    if min(len(first), len(last)) < STEADY_LEAST:
        return ""
    said = []
    for name, value, within in (
            ("requests", len, STEADY_COUNT_WITHIN),
            ("mean prompt", lambda h: sum(len(r.prompt) for r in h) / len(h), STEADY_MEAN_WITHIN),
            ("mean output", lambda h: sum(r.max_tokens for r in h) / len(h), STEADY_MEAN_WITHIN)):
        a, b = value(first), value(last)
        if min(a, b) <= 0 or max(a, b) / min(a, b) > within:
            return ""
        said.append(f"{name} {a:.3g} / {b:.3g}")
    return (f"the window is steady (its first and last thirds: {', '.join(said)}), so this look "
            "needs no other to agree (--confirm)")


def looks_needed(confirm: int, repeating: bool, reqs) -> tuple[int, str]:
    """How many looks in a row must want a switch, and why one is enough ("" or
    :func:`steady`'s reason): ``--confirm`` when repeating (``--every``) on a window that is
    not steady, else one."""
    if not repeating:
        return 1, ""
    calm = steady(reqs)
    return (1, calm) if calm else (confirm, "")


class Streak:
    """How many looks in a row wanted the same switch (the same current layout, the same
    best), for ``--confirm``; any other answer, or a switch made, starts it again."""

    def __init__(self) -> None:
        self.key: tuple[str, str] | None = None
        self.count = 0

    def agreed(self, current: str, best: str) -> int:
        """Looks in a row before this one that wanted ``current`` -> ``best``."""
        return self.count if self.key == (current, best) else 0

    def record(self, current: str, v: Verdict, switched: bool) -> None:
        if v.wants and not switched:
            key = (current, v.best["layout"])
            self.count = self.count + 1 if self.key == key else 1
            self.key = key
        else:
            self.reset()

    def reset(self) -> None:
        """A look that decided nothing (too few requests, an error) breaks the row too."""
        self.key, self.count = None, 0


def worker_groups(ranks: dict[str, str]) -> dict[str, tuple[int, str]]:
    """Each worker's tensor-parallel size and device kind from its registry ``ranks``
    ("2 ranks on cuda:0 (pids ...)"); an older worker that does not say: (1, "")."""
    out = {}
    for w, text in ranks.items():
        m = re.match(r"(\d+) ranks? on (\w+)", text or "")
        out[w] = (int(m.group(1)), m.group(2)) if m else (1, "")
    return out


def pick_profile(profiles: dict, groups: dict[str, tuple[int, str]]):
    """The profile for these workers: all of one tensor-parallel size, on the device kind the
    profile was measured on. Raises ValueError naming what does not match."""
    sizes = sorted({tp for tp, _ in groups.values()})
    if len(sizes) > 1:
        raise ValueError(f"the workers have tensor-parallel sizes {sizes}: the live tuner "
                         "switches workers of one size (each pool's size is fixed by its "
                         "processes); `baton tune --trace` compares pools of different sizes")
    profile = profiles.get(sizes[0]) if sizes else None
    if profile is None:
        raise ValueError(f"the workers run at tensor-parallel size {sizes[0]}, and no profile "
                         f"is at that size (have {sorted(profiles)}): `baton profile "
                         f"--tensor-parallel-size {sizes[0]}`, then --tp-profile FILE")
    kinds = {kind for _, kind in groups.values() if kind}
    mine = profile.device.split(":")[0]
    if kinds and kinds != {mine}:
        raise ValueError(f"the profile was measured on {profile.device}, the workers run on "
                         f"{', '.join(sorted(kinds))}: `baton profile --device "
                         f"{sorted(kinds)[0]}` on their machine")
    return profile


def with_workers_settings(profile, records):
    """``profile`` with the workers' own engine settings from their registry entries: the
    simulated engines admit ``max_num_seqs`` requests and hold ``num_blocks`` KV blocks as the
    workers do, not as the profiling run's engine did (a `baton up` worker's pool is often a
    tenth of a profile's 1 GiB); a setting no worker states (older workers) stays the profile's.
    Raises ValueError when the workers differ in one (the simulator runs one engine setting
    for all) or run another dtype, block size, model, processor or (on a CPU) thread count than
    the profile's (its costs were measured at them; "" and 0: an older worker or profile that
    does not say)."""
    import dataclasses

    off = sorted({r.dtype for r in records if r.dtype} - {profile.dtype})
    if off:
        # a step's time moves with the weights' precision: on a 2-core CPU a float32
        # cluster decoded 16 streams at 1.4-1.8x the times of a bfloat16 one
        raise ValueError(f"the profile was measured at --dtype {profile.dtype}, the workers "
                         f"run at {', '.join(off)}: `baton profile --dtype {off[0]}`, or start "
                         f"the workers at --dtype {profile.dtype}")

    sizes = {r.block_size for r in records if r.block_size}
    if sizes and sizes != {profile.block_size}:
        raise ValueError(f"the profile was measured at --block-size {profile.block_size}, the "
                         f"workers run at {', '.join(map(str, sorted(sizes)))}: `baton profile` "
                         "at theirs")
    others = sorted({r.model or r.fingerprint[:16] for r in records
                     if r.fingerprint and r.fingerprint != profile.fingerprint})
    if profile.fingerprint and others:
        # the fingerprint holds the architecture and weights (and the KV layout, the FP8
        # matmuls): another model, or the same name with other weights, runs at other costs
        raise ValueError(f"the profile was measured on the model "
                         f"{profile.model_name or profile.model} (fingerprint "
                         f"{profile.fingerprint[:16]}), the workers serve "
                         f"{', '.join(others)}: `baton profile --model` with theirs")
    machines = sorted({r.processor for r in records if r.processor} - {profile.processor})
    if profile.processor and machines:
        # a step's time moves with the processor: a 1,024-token bfloat16 prefill step of
        # SmolLM2 took 0.40 s on a 2-vCPU Xeon with AMX and 1.43 s on a 2-vCPU EPYC, whose
        # decode steps took the same time (their profiles of 2026-12-03)
        raise ValueError(f"the profile was measured on {profile.processor}, the workers run "
                         f"on {'; '.join(machines)}: `baton profile` on their machine")
    threads = sorted({r.threads for r in records if r.threads} - {profile.threads})
    if threads and profile.device.split(":")[0] == "cpu":  # as pick_profile reads its kind
        # a profile times each worker at its --threads on cores of its own: a worker of
        # two threads on two cores runs its steps at other times than one of one
        raise ValueError(f"the profile was measured at {profile.threads} torch thread(s) a "
                         f"worker, the workers run {', '.join(map(str, threads))}: start them "
                         f"with --threads {profile.threads} (`baton up --threads "
                         f"{profile.threads}`), or measure theirs (`baton profile --threads "
                         f"{threads[0]}`)")
    changes = {}
    for name, flag in (("max_num_seqs", "--max-num-seqs"), ("num_blocks", "KV pool blocks")):
        told = sorted({getattr(r, name) for r in records if getattr(r, name)})
        if len(told) > 1:
            raise ValueError(f"the workers differ in {flag} ({', '.join(map(str, told))}): the "
                             "simulator runs one engine setting for every worker")
        if told:
            changes[name] = told[0]
    return dataclasses.replace(profile, **changes)


def validation_error(results: Path) -> str:
    """The prediction error of the newest tune validation under ``results``."""
    files = sorted(glob.glob(str(results / "tune-validation-2*.json")))
    if not files:
        return "no tune validation on record (python bench/tune_validation.py)"
    d = json.loads(Path(files[-1]).read_text())
    errs = [d["predicted"][k]["goodput_rps"] / m["goodput_rps"] - 1
            for k, m in d["measured"].items() if m.get("goodput_rps")]
    worst = max(errs, key=abs) if errs else float("nan")
    cal = [p["error"] for c in (d.get("calibrated") or {}).values()
           for p in (c.get("predicted") or {}).values() if p.get("error") is not None]
    calibrated = (f", {100 * max(cal, key=abs):+.0f}% calibrated on a measured run as the live "
                  "tuner calibrates" if cal else "")
    return (f"the last validation predicted goodput within {100 * worst:+.0f}% of measured"
            f"{calibrated} ({Path(files[-1]).name})")


def fetch_workload(router: str, dest: Path, timeout: float = 30.0) -> int:
    """The router's live workload into ``dest``; returns its number of requests."""
    base = router if "://" in router else f"http://{router}"
    req = urllib.request.Request(base.rstrip("/").removesuffix("/v1") + "/v1/baton/workload")
    key = os.environ.get("BATON_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    dest.write_bytes(body)
    return sum(1 for line in body.splitlines() if line.strip())


def set_role(address: str, role: str, timeout: float = 30.0):
    """A worker's ``WorkerAdmin.SetRole`` (with this process's cluster secret): its answer;
    raises RuntimeError naming the status when it refuses or does not answer."""
    import grpc
    from baton.transfer import cluster_secret
    from baton.v1 import worker_pb2, worker_pb2_grpc

    try:
        with cluster_secret.channel(address) as ch:
            return worker_pb2_grpc.WorkerAdminStub(ch).SetRole(
                worker_pb2.SetRoleRequest(role=role), timeout=timeout)
    except grpc.RpcError as e:
        raise RuntimeError(f"{e.code().name}: {e.details()}") from None


def apply(registry, target: dict[str, str], roles: dict[str, str], gap_s: float,
          say) -> tuple[list[tuple[str, str, str]], str]:
    """Switch roles one worker at a time (``gap_s`` between, for the routers' registry reads);
    returns (worker, from, to) per switch made, and "" or the refusal that stopped it (the
    switches before it stay made)."""
    address = {w.worker_id: w.address for w in registry.workers()}
    done = []
    for i, (wid, role) in enumerate(switches(roles, target)):
        if i:
            time.sleep(gap_s)
        try:
            set_role(address[wid], role)
        except RuntimeError as e:
            return done, f"{wid}: {e}"
        say(f"switched {wid}: {roles[wid]} -> {role}")
        done.append((wid, roles[wid], role))
    return done, ""


def live_once(cfg, registry, say, fits: dict | None = None,
              streak: Streak | None = None) -> dict:
    """One look at the live cluster (and with cfg.apply, the switches); its summary.
    ``fits`` (tensor-parallel size -> :class:`~baton.control.calibrate.Fits`) carries the
    calibration's fits from look to look (``run_live``'s; None: this look's alone);
    ``streak`` the looks in a row that wanted the same switch (None: a single look, which
    needs no other to agree)."""
    from baton.control.calibrate import Fits, calibrate, from_window, served
    from baton.control.tune import Evaluator, layouts, load_trace, shape

    records = registry.workers()
    roles = {w.worker_id: w.role for w in records}
    if len(roles) < 2:
        return {"action": "none", "reason": f"{len(roles)} worker(s): nothing to split"}
    try:
        profile = with_workers_settings(
            pick_profile(cfg.profiles, worker_groups({w.worker_id: w.ranks for w in records})),
            records)
    except ValueError as e:  # a profile that does not fit: an error (a single look exits 1)
        return {"action": "none", "reason": f"error: switches nothing: {e}"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "live.jsonl"
        n = fetch_workload(cfg.live, path)
        if n < cfg.min_requests:
            return {"action": "none", "requests": n, "filling": True,
                    "reason": f"{n} requests in the router's window, under --min-requests "
                              f"{cfg.min_requests}: switches nothing"}
        reqs = load_trace(replace(cfg.tune.slice, trace=str(path), format="baton",
                                  requests=n, trace_start=0))
        tp = profile.tensor_parallel_size
        cur = current_layout(roles, tp)
        calibrate_on = cfg.calibrate and cur is not None
        rows_read = sorted((json.loads(line) for line in path.read_text().splitlines()
                            if line.strip()), key=lambda r: r["at"])  # as load_trace orders it
        window = rows_read if calibrate_on else []
    ev = Evaluator(profile, reqs, cfg.tune.search, cfg.tune.knobs)
    calibration = None
    if calibrate_on:
        kept = (fits if fits is not None else {}).setdefault(tp, Fits())
        now_s = time.monotonic()
        search = cfg.tune.search
        calibration = kept.take(
            lambda: calibrate(profile, cur, shape(reqs, ev.keys), from_window(window),
                              cfg.tune.knobs),
            now_s, served(window, search.ttft_slo, search.tpot_slo), search.attainment,
            profile)
        # what this window fitted, and the last fit of every factor it could not
        used = kept.profile(profile)
        ev = ev.with_profile(used)
    rows = []
    for layout in layouts(len(roles), tp, tp):
        goodput, points = ev.goodput(layout)
        rows.append({"layout": layout.name, "prefill": layout.prefill,
                     "decode": layout.decode, "colocated": layout.colocated,
                     "goodput_rps": goodput,
                     "goodput_below_rps": lowest_failing(points, cfg.tune.search.attainment),
                     "attainment_live": ev.at(layout, None)})
    last = registry.redis.get(LAST_APPLY)
    dwell_left = cfg.min_dwell - (time.time() - float(last)) if last else 0.0
    now_name = cur.name if cur else "mixed"
    confirm, calm = looks_needed(cfg.confirm, streak is not None, reqs)
    rate = arrival_rate([r.at for r in reqs])
    agreed = (streak.agreed(now_name, best_row(rows, rate)["layout"]) if streak is not None
              else 0)
    refined = searched_finer(rows, cur, cfg.min_gain, rate, ev, tp, cfg.tune.search.attainment)
    v = verdict(rows, cur, cfg.min_gain, dwell_left, agreed, confirm, rate)
    if refined:
        v = replace(v, reason=f"{v.reason} (goodputs searched {refined} steps finer)")
    if v.act and calm and agreed + 1 < cfg.confirm:  # calm: only ever said when repeating
        v = replace(v, reason=f"{v.reason}; {calm}")  # what let it act on this look alone
    measured = served(rows_read, cfg.tune.search.ttft_slo, cfg.tune.search.tpot_slo)
    out = {"requests": len(reqs), "workers": roles, "current": now_name,
           "attainment_measured": measured, "window_rps": rate,
           "configurations": rows, "recommended": v.best["layout"], "gain": v.gain,
           "ranked_by": v.by, "steady": calm, "refined": refined,
           "reason": v.reason, "validation": validation_error(cfg.results), "action": "none",
           "profile_unchecked": "" if profile.fingerprint else (
               "the profile records no model fingerprint (measured before Baton recorded "
               "one), so its model is not checked against the workers': `baton profile` "
               "again records it"),
           "sampling_unmeasured": _sampling_unmeasured(profile, reqs),
           "switches": [],
           "calibration": ({**calibration.summary(used), "kept": kept.summary(now_s)}
                           if calibration is not None else
                           {"applied": False, "notes": [
                               "off (--no-calibrate)" if not cfg.calibrate else
                               "the workers' roles match no layout"]})}
    if cfg.apply and v.act:
        best = Layout(v.best["prefill"], v.best["decode"], v.best["colocated"], tp, tp)
        out["switches"], refused = apply(registry, assignment(roles, best), roles, cfg.gap_s,
                                         say)
        if out["switches"]:  # the dwell counts from any switch made, all of them or not
            registry.redis.set(LAST_APPLY, str(time.time()))
            out["action"] = "switched"
        if refused:  # the look is reported with its layouts, and the roles it left
            out["reason"] = (f"error: {refused} ({len(out['switches'])} of the switches to "
                             f"{v.best['layout']} made)")
    if streak is not None:
        streak.record(now_name, v, bool(out["switches"]))
    return out


def undecided(rows: list[dict], current: Layout | None, min_gain: float,
              rate: float | None = None) -> list[dict]:
    """The rows whose goodput brackets leave the look undecided ([]: decided): ranked by
    goodput, no layout is surely --min-gain over the current one (its goodput over the
    lowest rate the current one failed), yet some might be (the lowest rate it failed over
    the current's goodput). Those and the current one's, to search finer."""
    if current is None or overloaded(rows, rate, "attainment_live"):
        return []
    cur = next((r for r in rows if r["layout"] == current.name), None)
    if cur is None or cur["goodput_rps"] <= 0 or cur.get("goodput_below_rps") is None:
        return []
    others = [r for r in rows if r is not cur]
    if any(r["goodput_rps"] / cur["goodput_below_rps"] - 1 >= min_gain for r in others):
        return []  # a gain past --min-gain whatever the brackets hold
    rivals = [r for r in others if r.get("goodput_below_rps") is not None
              and r["goodput_below_rps"] / cur["goodput_rps"] - 1 >= min_gain]
    return [cur, *rivals] if rivals else []


def searched_finer(rows: list[dict], current: Layout | None, min_gain: float,
                   rate: float | None, ev, tp: int, target: float) -> int:
    """Bisects the goodput brackets of :func:`undecided`'s rows 2 steps more at a time (in
    place; up to :data:`MORE_STEPS`) until the look is decided; the steps more searched.
    ``ev``: the look's evaluator (its ``at(layout, rate)``), ``tp`` the layouts' workers'
    tensor-parallel size."""
    refined = 0
    while refined < MORE_STEPS:
        todo = undecided(rows, current, min_gain, rate)
        if not todo:
            break
        refined += 2
        narrow_rows(todo, ev, tp, target, 2)
    return refined


def narrow_rows(rows: list[dict], ev, tp: int, target: float, steps: int) -> None:
    """``steps`` more bisections of each row's goodput bracket (``goodput_rps`` met the
    attainment target, ``goodput_below_rps`` failed), in place; a row with no failing rate
    above the one that met (every rate searched met it) stays."""
    from baton.control.workload import narrow

    for row in rows:
        hi = row.get("goodput_below_rps")
        if hi is None or hi <= row["goodput_rps"]:
            continue
        layout = Layout(row["prefill"], row["decode"], row["colocated"], tp, tp)
        row["goodput_rps"], row["goodput_below_rps"], _ = narrow(
            lambda r, layout=layout: ev.at(layout, r), row["goodput_rps"], hi, target, steps)


def _sampling_unmeasured(profile, reqs) -> str:
    """What the look says when the window's requests sample with filters the profile has no
    cost for ("" when it has them all, or none samples)."""
    used = {f for r in reqs for f in r.sampling}
    missing = sorted(used - set(profile.sampling))
    if not missing:
        return ""
    n = sum(1 for r in reqs if set(r.sampling) & set(missing))
    return (f"{n} of the window's {len(reqs)} requests sample with {', '.join(missing)}, which "
            "the profile has no cost for (measured before Baton timed the sampler): simulated "
            "at greedy's cost; `baton profile` again measures them")


def report(out: dict) -> str:
    lines = []
    if "configurations" in out:
        lines.append(f"{'configuration':<14} {'goodput req/s':>13} {'attain live':>12}")
        for r in out["configurations"]:
            mark = " (now)" if r["layout"] == out["current"] else ""
            lines.append(f"{r['layout']:<14} {r['goodput_rps']:>13.3g} "
                         f"{100 * r['attainment_live']:>11.0f}%{mark}")
        if out.get("attainment_measured") is not None:  # beside the simulated "now"
            lines.append(f"measured now: {100 * out['attainment_measured']:.0f}% of the "
                         "window's finished requests met both SLOs")
        if out.get("window_rps"):
            ranked = ("past every layout's goodput: ranked by attain live"
                      if out.get("ranked_by") == "attainment_live" else "ranked by goodput")
            lines.append(f"the window arrived at {out['window_rps']:.3g} req/s; {ranked}")
        lines.append(f"recommended: {out['recommended']}; {out['validation']}")
        for key in ("profile_unchecked", "sampling_unmeasured"):
            if out.get(key):
                lines.append(f"note: {out[key]}")
        cal = out.get("calibration") or {}
        if cal.get("applied"):
            lines.append(f"calibrated on the live window: decode factor x{cal['decode_ratio']:.3f}"
                         f", prefill factor x{cal['prefill_ratio']:.3f}")
        elif cal:
            lines.append("not calibrated: " + "; ".join(cal.get("notes") or []))
        carried = [f"{name.replace('_', ' ')} x{k['ratio']:.3f} ({k['age_s']:.0f} s old)"
                   for name, k in (cal.get("kept") or {}).items() if k and k["age_s"] > 0]
        if carried:
            lines.append("kept from earlier looks: " + ", ".join(carried))
    lines.append(f"{out['action']}: {out['reason']}")
    lines += [f"  {w}: {a} -> {b}" for w, a, b in out.get("switches", [])]
    return "\n".join(lines)


def next_look_in(out: dict, every: float, fill_every: float) -> float:
    """Seconds to the next look: --every, or sooner (--fill-every) while the router's window
    still holds fewer than --min-requests, so the first decision comes as soon as the window
    fills rather than up to a whole --every later."""
    return min(every, fill_every) if out.get("filling") else every


def run_live(cfg) -> int:
    from baton.control.redis_client import connect
    from baton.control.registry import WorkerRegistry
    from redis.exceptions import RedisError

    registry = WorkerRegistry(connect(cfg.redis_url, socket_timeout=5))

    def say(msg: str) -> None:
        print(f"[baton tune --live] {msg}", file=sys.stderr, flush=True)

    if cfg.nice:  # the workers' CPU first: a look waits for what they leave
        os.nice(cfg.nice)
    for tp, profile in sorted(cfg.profiles.items()):  # the calibration moves from there
        say(f"the profile of TP {tp} {profile.age()}")
        if (gap := profile.table_vs_grid()) is not None:
            say(f"warning: the profile of TP {tp}: {gap}")
    fits: dict = {}  # the calibration's fits, carried from look to look
    streak = Streak() if cfg.every else None  # --confirm counts repeated looks only
    while True:
        try:
            out = live_once(cfg, registry, say, fits, streak)
        except (OSError, RuntimeError) as e:  # the router or a worker did not answer
            out = {"action": "none", "reason": f"error: {e}"}
        except RedisError as e:  # down or restarting: a repeating tuner looks again after it
            out = {"action": "none", "reason": f"error: the cluster's Redis did not answer "
                                               f"({type(e).__name__}: {e}): switches nothing"}
        if streak is not None and "configurations" not in out:
            streak.reset()
        print(json.dumps(out, default=str) if cfg.json else report(out), flush=True)
        if not cfg.every:
            return 0 if not out["reason"].startswith("error") else 1
        time.sleep(next_look_in(out, cfg.every, cfg.fill_every))
