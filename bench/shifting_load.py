"""A load whose mix shifts, against each fixed layout of two workers and against the live tuner.

One trace of phases (default: prefill-heavy -> decode-heavy -> prefill-heavy, 4 minutes each,
Poisson arrivals at each phase's rate) is sent, back to back and alone on the machine, to:

- ``1P+1D``: a prefill and a decode worker (`baton bench compare`'s disaggregated setup);
- ``2 colocated``: two workers that prefill their own requests (its colocated setup);
- ``live``: starts as 1P+1D while ``baton tune --live ROUTER --apply`` runs beside it for the
  whole trace and switches roles when it predicts a gain.

Each setup gets a fresh Redis and workers pinned one per core (one torch thread), the same
router flags (``--workload-window``, the HTTP front the tuner reads), the same lengths and
arrival times (fresh prompt tokens per run, so no run finds another's prefix cache). Goodput
is the requests that met both SLOs per second of the trace; also per phase, failed requests,
and the tuner's every look and switch. JSON in bench/results/shifting-load-*.json.

The decode-heavy phase overloads every layout, and there the requests that meet the SLOs move
far more than the machine's speed does: the same colocated setup on the same trace met 120 and
300 requests in two runs 16 minutes apart, its TPOT median in the decode-heavy phase 173 ms in
the first and 153 ms in the second (`bench/colocated_forms.py`). So before and after each
setup the machine's speed is measured (`baton profile --check` against the tuner's profile:
its prefill and decode step ratios, ~15 s) and kept with the setup's result, and ``--rounds
N`` runs the setups N times, each round in the reverse order of the one before (1P+1D,
colocated, live; then live, colocated, 1P+1D), so a machine that slows or speeds up over the
hour weighs on every setup alike. Each round is scored on its own (as a one-round run is) and
all rounds pooled: each setup's met requests over all its rounds. Stopped part way (Ctrl-C or
SIGTERM; a round takes ~50 min), the running setup's processes stop, the setups that finished
are written with ``stopped`` saying where, and the ratios score the rounds every setup
finished (exit status 130).

Beside the measured setups, the simulator's account of each fixed layout on the same trace with
the tuner's profile (met requests per phase; ~1 s): how far the costs the tuner decides on are
from this machine's. ``--replay RESULT.json`` prints that comparison for a run already written,
with the ``--profile`` given (the machine's own profile, say), and runs nothing.

    python bench/shifting_load.py [--minutes 4] [--profile FILE] [--only live] [--rounds 1]
        [--tuner-every 30] [--tuner-min-dwell 90] [--tuner-confirm 2] [--tuner-min-requests 20]
        [--window 60] [--clients 512]
    python bench/shifting_load.py --replay bench/results/shifting-load-STAMP.json --profile FILE

Before any setup starts, a trace the profile's machine cannot serve is refused: when the
simulator gives no fixed layout :data:`MIN_MET` requests within both SLOs, the setups would
only compare overloads (``--anyway`` runs it all the same).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from baton.bench.common import (
    RESULTS,
    PauseWatch,
    machine,
    other_processor,
    sigterm_as_ctrl_c,
    write_result,
)
from baton.bench.loadgen import OPEN_LOOP_CLIENTS

SETUPS = ("1P+1D", "2 colocated", "live")
FIXED = {"1P+1D": (1, 1, False), "2 colocated": (0, 2, True)}  # (prefill, decode, colocated)
# The fewest requests the best fixed layout must be simulated to meet (both SLOs) for a run
# (an hour) to start. It catches the hopeless only: a profile of another machine can be far
# off (the default profile, version 6 of another VM kind, simulates colocated at 27 where runs
# on the faster VM kind measured 200-300; the faster kind's own profiles simulate 134 and
# 237; the slower kind's own, 5, and its run measured 6).
MIN_MET = 20


@dataclass(frozen=True)
class Phase:
    name: str
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    rate: float  # requests per second


# Fixed before the first run (with the SLOs): prefill-heavy is Azure-code-like (long prompts,
# short answers), decode-heavy chat-like (short prompts, long answers); rates near the two
# layouts' capacity for each mix on the 2-core machine.
PHASES = (Phase("prefill-heavy", (1000, 2000), (16, 64), 0.7),
          Phase("decode-heavy", (64, 256), (128, 256), 5.0),
          Phase("prefill-heavy", (1000, 2000), (16, 64), 0.7))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="each phase (default 4)")
    ap.add_argument("--only", default=",".join(SETUPS),
                    help=f"comma-separated setups (default {','.join(SETUPS)})")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--profile", default=str(RESULTS / "tune-validation-profile.json"),
                    help="the tuner's costs (`baton profile`; default the validation's)")
    ap.add_argument("--ttft-slo", type=float, default=4.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--window", type=float, default=60.0,
                    help="the routers' --workload-window: what the tuner sees (seconds)")
    ap.add_argument("--tuner-every", type=float, default=30.0)
    ap.add_argument("--tuner-min-dwell", type=float, default=90.0)
    ap.add_argument("--tuner-min-gain", type=float, default=0.05)
    ap.add_argument("--tuner-confirm", type=int, default=2,
                    help="the tuner's --confirm (runs 1-16 had none: one look switched)")
    ap.add_argument("--tuner-refine", type=int, default=2)
    ap.add_argument("--tuner-min-requests", type=int, default=20,
                    help="the tuner's --min-requests: the fewest requests in the window it "
                         "decides on (default 20, as runs 1-29 had)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=OPEN_LOOP_CLIENTS,
                    help=f"client threads sending the trace (default {OPEN_LOOP_CLIENTS}, as "
                         "every run so far had): past that many outstanding, requests wait "
                         "for a client and reach the router late (timed from their arrival "
                         "all the same; `late_over_1s` counts them)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the setups this many times, each round in the reverse order of "
                         "the one before; scored per round and pooled (default 1)")
    ap.add_argument("--no-speed-check", dest="speed_check", action="store_false",
                    help="skip the machine speed check before and after each setup")
    ap.add_argument("--anyway", action="store_true",
                    help=f"run even when the simulator says no fixed layout meets both SLOs "
                         f"for {MIN_MET} requests on this profile (refused otherwise)")
    ap.add_argument("--replay", default=None, metavar="RESULT",
                    help="run nothing: a written run's measured fixed layouts against the "
                         "simulator's on its trace, with --profile's costs")
    return ap.parse_args(argv)


def round_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, setup) in the order they run: each round the reverse of the one before."""
    return [(r, n) for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]


def speed_check(a: argparse.Namespace) -> dict:
    """The machine's speed now against the tuner's profile (`baton profile --check`, both
    cores, the idle machine): its last line's JSON, or the error."""
    cmd = [sys.executable, "-m", "baton.cli.main", "profile", "--dtype", a.dtype, "--cores",
           "0,1", "--check", a.profile]
    if a.model:
        cmd += ["--model", a.model]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, json.JSONDecodeError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def trace(phases, minutes: float, seed: int) -> list[tuple[int, int, float, int]]:
    """(prompt tokens, output tokens, arrival s, phase index) for every request."""
    rng, out, start = random.Random(seed), [], 0.0
    for i, ph in enumerate(phases):
        t, end = start, start + minutes * 60
        while True:
            t += rng.expovariate(ph.rate)
            if t >= end:
                break
            out.append((rng.randint(*ph.input_len), rng.randint(*ph.output_len), t, i))
        start = end
    return out


def config(a: argparse.Namespace, kind: str):
    """`baton bench compare`'s settings for one setup: the same workers and router flags."""
    from baton.bench.cli import CompareConfig, add_bench_args

    ap = argparse.ArgumentParser()
    add_bench_args(ap)
    args = ["compare", "--dtype", a.dtype, "--quiet", "--no-plots", "--prefill", "1",
            "--decode", "1", "--colocated", "2", "--max-input", "2048",
            "--router-args", f"--workload-window {a.window} --http-port 0"]
    if a.model:
        args += ["--model", a.model]
    return replace(CompareConfig.from_args(ap.parse_args(args)), only=kind)


class Tuner:
    """`baton tune --live ROUTER --apply --every S --json` beside the trace; its looks."""

    def __init__(self, a: argparse.Namespace, router_http: str, redis_url: str) -> None:
        cmd = [sys.executable, "-m", "baton.cli.main", "tune", "--live", router_http,
               "--redis-url", redis_url, "--apply", "--json", "--profile", a.profile,
               "--ttft-slo", str(a.ttft_slo), "--tpot-slo", str(a.tpot_slo),
               "--every", str(a.tuner_every), "--min-dwell", str(a.tuner_min_dwell),
               "--min-gain", str(a.tuner_min_gain), "--refine", str(a.tuner_refine),
               "--confirm", str(a.tuner_confirm), "--min-requests", str(a.tuner_min_requests),
               "--max-input", "2048", "--max-output", "256"]
        self.cmd, self.looks, self.t0 = cmd, [], time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                look = json.loads(line)
            except json.JSONDecodeError:
                continue
            look["at_s"] = time.monotonic() - self.t0
            self.looks.append(look)
            print(f"  tuner at {look['at_s']:.0f}s: {look['action']}: {look['reason']}",
                  file=sys.stderr, flush=True)

    def stop(self) -> dict:
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self._reader.join(timeout=5)
        switches = [s + [look["at_s"]] for look in self.looks
                    for s in look.get("switches", [])]
        return {"command": self.cmd, "looks": self.looks, "switches": switches,
                "switch_count": len(switches), "stderr_tail": (err or "")[-2000:]}


def run_setup(a: argparse.Namespace, name: str, shape, phases, kind: str | None = None,
              prepare=None) -> dict:
    """One setup on a fresh Redis and workers: the trace, scored. ``kind``: `baton bench
    compare`'s (default: colocated for ``2 colocated``, else disaggregated); ``prepare(redis
    url)`` runs after the warm-up, before the trace (bench/colocated_forms.py switches roles
    there)."""
    from baton.bench import loadgen as lg
    from baton.bench.compare import Setup
    from baton.control.redis_server import EmbeddedRedis

    kind = kind or ("colocated" if name == "2 colocated" else "disaggregated")
    cfg = config(a, kind)
    tokens = lg.Tokens(100, 10000, f"shifting-{name}-{time.time()}")
    rng = random.Random(f"{a.seed}/{tokens.salt}")
    reqs = [lg.Req(tokens.random(rng, p), o, t) for p, o, t, _ in shape]
    redis = EmbeddedRedis().start()
    tuner = None
    try:
        setup = Setup(cfg, kind, redis.url)
        target = lg.GrpcTarget(setup.router.address)
        try:
            lg.warm_up(target)
            if prepare is not None:
                prepare(redis.url)
            if name == "live":
                tuner = Tuner(a, setup.router.http_address, redis.url)
            procs = _processes(setup, tuner)
            before = {k: _cpu_s(pid) for k, pid in procs.items()}
            watch = PauseWatch()
            try:
                records, wall = lg.run(target, reqs, progress=_progress(name, len(reqs)),
                                       clients=a.clients)
            finally:
                pauses = watch.stop()
            cpu = {k: round(_cpu_s(pid) - before[k], 1) for k, pid in procs.items()}
            roles = _roles(redis.url)
            tuned = tuner.stop() if tuner else None
        finally:
            if tuner and tuner.proc.poll() is None:
                tuner.proc.kill()
            target.close()
            setup.stop()
    finally:
        redis.stop()
    out = _score(a, name, records, wall, shape, phases, tuned, roles)
    out["cpu_s"], out["pauses"] = cpu, pauses
    return out


def _processes(setup, tuner) -> dict[str, int]:
    """The setup's processes by name (its workers as they started, the router, the tuner, this
    process as the clients): each one's CPU over the trace goes in the result, so a setup that
    loses to another on the same layout shows where the cores went."""
    out = {f"{'both' if setup.kind == 'colocated' else p.role} worker {i}": p.pid
           for i, p in enumerate(setup.procs) if p is not setup.router}
    out["router"] = setup.router.pid
    if tuner is not None:
        out["tuner"] = tuner.proc.pid
    out["clients"] = os.getpid()
    return out


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of ``pid`` and its threads so far (/proc; its children not
    counted)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _roles(url: str) -> list[str]:
    from baton.control.registry import WorkerRegistry

    return sorted(w.role for w in WorkerRegistry.from_url(url).workers())


def _progress(name: str, total: int):
    last = [0.0]

    def say(done: int, n: int) -> None:
        if time.monotonic() - last[0] > 30 or done == n:
            last[0] = time.monotonic()
            print(f"  {name}: {done}/{total} done", file=sys.stderr, flush=True)
    return say


def _score(a, name, records, wall, shape, phases, tuned, roles) -> dict:
    from baton.bench import loadgen as lg

    duration = len(phases) * a.minutes * 60
    per_phase = []
    for i, ph in enumerate(phases):
        rs = [r for r, s in zip(records, shape) if s[3] == i]
        s = lg.summarize(rs, a.minutes * 60, a.ttft_slo, a.tpot_slo)
        good = sum(lg.meets(r, a.ttft_slo, a.tpot_slo) for r in rs)
        per_phase.append({"phase": ph.name, "requests": len(rs), "met_slo": good,
                          "goodput_rps": good / (a.minutes * 60), "attainment": s["attainment"],
                          "failed": len(rs) - s["succeeded"], "errors": s["errors"],
                          "error_details": s["error_details"],
                          "ttft_s": s["ttft_s"], "tpot_s": s["tpot_s"], "late_s": s["late_s"]})
    good = sum(lg.meets(r, a.ttft_slo, a.tpot_slo) for r in records)
    failed = sum(r.error is not None for r in records)
    out = {"setup": name, "requests": len(records), "met_slo": good,
           "goodput_rps": good / duration, "attainment": good / len(records) if records else 0,
           "failed": failed, "wall_s": wall, "phases": per_phase, "roles_at_end": roles,
           "outstanding_peak": outstanding_peak(records),
           "late_over_1s": sum(r.late > 1.0 for r in records), "paths": path_counts(records)}
    if tuned is not None:
        out["tuner"] = tuned
    return out


def path_counts(records) -> dict[str, int]:
    """How many served requests took each path the router names: remote (a prefill worker),
    local (the decode worker prefilled), migrated (resumed on another decode worker after its
    first failed or went silent: a pause the router took for a stall shows here)."""
    from collections import Counter

    return dict(sorted(Counter(r.path for r in records if r.error is None and r.path).items()))


def outstanding_peak(records) -> int:
    """The most requests arrived and not yet ended at once: past the load generator's clients
    (`bench/loadgen.py run`), the rest wait for one, late (``late_over_1s``)."""
    events = sorted([(r.sent, 1) for r in records]
                    + [(r.end if r.end is not None else r.sent + r.late, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    peak = n = 0
    for _, d in events:
        n += d
        peak = max(peak, n)
    return peak


def main(argv=None) -> int:
    a = parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    bad = [n for n in names if n not in SETUPS]
    if bad or not names:
        print(f"error: --only: unknown setup(s) {bad}; choose from {', '.join(SETUPS)}",
              file=sys.stderr)
        return 2
    if not Path(a.profile).is_file():
        print(f"error: --profile {a.profile}: no such file (run `baton profile`; the tuner, "
              "the speed check and the simulator read it)", file=sys.stderr)
        return 2
    if a.rounds < 1:
        print(f"error: --rounds {a.rounds}: must be >= 1", file=sys.stderr)
        return 2
    if a.clients < 1:
        print(f"error: --clients {a.clients}: must be >= 1", file=sys.stderr)
        return 2
    if a.replay is not None:
        return replay(a)
    shape = trace(PHASES, a.minutes, a.seed)
    print(f"{len(shape)} requests in {len(PHASES)} phases of {a.minutes:g} min: "
          + ", ".join(f"{p.name} {p.rate:g}/s" for p in PHASES), file=sys.stderr)
    # before any setup: a profile the simulator cannot read fails here, not after the run
    sim = simulated(a, shape, PHASES)
    if sim is None:
        return 2
    from baton.control.profile import Profile

    if why := other_processor(Profile.load(a.profile)):  # the tuner's refusal, at every look
        print(f"error: --profile {a.profile}: {why}: the live tuner refuses a profile of "
              "another machine", file=sys.stderr)
        return 2
    if (why := out_of_reach(sim)) and not a.anyway:
        print(f"error: {why}", file=sys.stderr)
        return 2
    results: list[dict] = []
    stopped = None
    with sigterm_as_ctrl_c():  # as Ctrl-C: the running setup stops
        try:
            for r, name in round_order(names, a.rounds):
                stopped = f"{name} round {r + 1}"
                print(f"== {name} (round {r + 1} of {a.rounds})", file=sys.stderr, flush=True)
                before = speed_check(a) if a.speed_check else None
                res = run_setup(a, name, shape, PHASES)
                res["round"] = r
                if a.speed_check:
                    res["speed"] = {"before": before, "after": speed_check(a)}
                    print(f"  speed: {speed_line(res['speed'])}", file=sys.stderr, flush=True)
                results.append(res)
            stopped = None
        except KeyboardInterrupt:
            print(f"stopped during {stopped}", file=sys.stderr, flush=True)
            if not results:
                print("no setup had finished: nothing written", file=sys.stderr)
                return 130
    rounds = a.rounds if stopped is None else complete_rounds(results, names)
    scored = [x for x in results if x["round"] < rounds]
    summary = pooled(scored, rounds) if rounds else {
        "failed_requests": sum(x["failed"] for x in results)}
    out = {"machine": machine(), "args": vars(a), "argv": sys.argv,
           "phases": [vars(p) for p in PHASES], "results": results, "summary": summary,
           "simulated": sim}
    if stopped is not None:
        out["stopped"] = {"during": stopped, "rounds_scored": rounds}
    print(table(results, summary) + "\n" + sim_table(results, sim))
    if stopped is not None:
        print(f"stopped during {stopped}: the ratios score the {rounds} round(s) every setup "
              "finished; the setups listed past them are not scored")
    path = write_result("shifting-load", out)
    print(f"wrote {path}")
    return 0 if stopped is None else 130


def complete_rounds(results: list[dict], names: list[str]) -> int:
    """How many rounds, from the first, every setup of ``names`` finished (a run stopped
    part way scores those)."""
    n = 0
    while names and all(any(x["round"] == n and x["setup"] == name for x in results)
                        for name in names):
        n += 1
    return n


def out_of_reach(sim: dict) -> str | None:
    """Why the trace is beyond the profile's machine (no fixed layout simulated to meet both SLOs
    for :data:`MIN_MET` requests), or None. Such a run compares overloads: on the slower VM kind
    of 2026-12-02 (its own profile) the simulator gave 1P+1D 1 and colocated 5 met requests of
    1,572 (the router before its ``prefill`` scorer), the run measured 1, 6 and the live tuner
    1, an hour for ratios of single requests."""
    met = {name: s["met_slo"] for name, s in sim["layouts"].items()}
    if max(met.values()) >= MIN_MET:
        return None
    n = next(iter(sim["layouts"].values()))["requests"]
    return (f"on --profile {sim['profile']}'s costs no fixed layout meets both SLOs for "
            f"{MIN_MET} of the trace's {n} requests ("
            + ", ".join(f"{name} {m}" for name, m in met.items())
            + "): the setups' ratios would compare overloads; a machine this slow needs its "
            "own workload, or --anyway to run it all the same")


def simulated(a: argparse.Namespace, shape, phases) -> dict | None:
    """The simulator on the whole trace for each fixed layout, with ``a.profile``'s costs and
    the routers' default settings (the setups'), scored as a measured setup is (:func:`_score`
    with ``a``'s minutes and SLOs). None, the error printed, for a profile it cannot read."""
    from baton.control.profile import Profile, ProfileError
    from baton.control.sim import Layout, simulate

    try:
        prof = Profile.load(a.profile)
        want = getattr(a, "dtype", None)  # a replayed run's args: older runs' may not say
        if want and prof.dtype != want:  # the tuner would refuse it at every look
            raise ProfileError(f"measured at --dtype {prof.dtype}, the setups' workers run at "
                               f"--dtype {want}: pass --dtype {prof.dtype}, or profile at "
                               f"{want}")
        if prof.threads != 1:  # as the setups' workers run, one thread on a core each
            raise ProfileError(f"measured at --threads {prof.threads}, the setups' workers run "
                               "one torch thread each: profile at --threads 1")
        layouts = {name: _score(a, name, simulate(Layout(*spec), prof, [x[:3] for x in shape]),
                                None, shape, phases, None, None)
                   for name, spec in FIXED.items()}
    except ProfileError as e:
        print(f"error: --profile {a.profile}: {e}", file=sys.stderr)
        return None
    return {"profile": str(a.profile), "layouts": layouts}


def sim_table(results: list[dict], sim: dict) -> str:
    """Each fixed layout's met requests (by phase), simulated beside every measured round."""
    def row(label: str, r: dict) -> str:
        tpot = [(p.get("tpot_s") or {}).get("p50") for p in r["phases"]]
        return (f"  {label:<24} {r['met_slo']:>5} ("
                + " / ".join(str(p["met_slo"]) for p in r["phases"]) + ")  TPOT "
                + " / ".join("-" if x is None else f"{1000 * x:.0f}" for x in tpot))

    lines = [f"simulated with {sim['profile']} (met both SLOs, by phase; TPOT median ms):"]
    for name, s in sim["layouts"].items():
        lines.append(row(f"{name} simulated", s))
        for r in results:
            if r["setup"] == name:
                err = r["met_slo"] and s["met_slo"] / r["met_slo"] - 1
                lines.append(row(f"{name} round {r.get('round', 0) + 1}", r)
                             + (f"  (simulated {100 * err:+.0f}%)" if r["met_slo"] else ""))
    return "\n".join(lines)


def replay(a: argparse.Namespace) -> int:
    """``--replay``: the simulator against a written run's fixed layouts, nothing started."""
    try:
        d = json.loads(Path(a.replay).read_text())
        phases = [Phase(**{**p, "input_len": tuple(p["input_len"]),
                           "output_len": tuple(p["output_len"])}) for p in d["phases"]]
        run = argparse.Namespace(**{**d["args"], "profile": a.profile})
        results = d["results"]
        shape = trace(phases, run.minutes, run.seed)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"error: --replay {a.replay}: not a shifting-load result ({type(e).__name__}: "
              f"{e})", file=sys.stderr)
        return 2
    if results and len(shape) != results[0]["requests"]:
        print(f"error: --replay {a.replay}: its trace had {results[0]['requests']} requests, "
              f"this script's makes {len(shape)} from its phases and seed", file=sys.stderr)
        return 2
    sim = simulated(run, shape, phases)
    if sim is None:
        return 2
    print(sim_table(results, sim))
    return 0


def pooled(results: list[dict], rounds: int) -> dict:
    """One round: :func:`summarize`. More: each round's summary, and the summary of every
    setup's met requests over all its rounds (``pooled``)."""
    if rounds == 1:
        return summarize(results)
    per_round = [summarize([x for x in results if x["round"] == r]) for r in range(rounds)]
    setups = []
    for name in dict.fromkeys(x["setup"] for x in results):
        mine = [x for x in results if x["setup"] == name]
        met, n = sum(x["met_slo"] for x in mine), sum(x["requests"] for x in mine)
        rate = sum(x["goodput_rps"] for x in mine) / len(mine)
        tuned = [x["tuner"]["switch_count"] for x in mine if "tuner" in x]
        out = {"setup": name, "met_slo": met, "requests": n, "goodput_rps": rate,
               "failed": sum(x["failed"] for x in mine)}
        if tuned:
            out["tuner"] = {"switch_count": sum(tuned)}
        setups.append(out)
    return {**summarize(setups), "rounds": per_round}


def speed_line(speed: dict) -> str:
    def one(c: dict | None) -> str:
        if not c or "error" in c:
            return (c or {}).get("error", "not measured")
        return f"prefill {c['prefill_ratio']:.2f}x, decode {c['decode_ratio']:.2f}x"
    return f"before {one(speed.get('before'))}; after {one(speed.get('after'))} (the profile's)"


def summarize(results: list[dict]) -> dict:
    fixed = [r for r in results if r["setup"] != "live"]
    live = next((r for r in results if r["setup"] == "live"), None)
    out: dict = {"failed_requests": sum(r["failed"] for r in results)}
    if live and fixed:
        best = max(fixed, key=lambda r: r["goodput_rps"])
        worst = min(fixed, key=lambda r: r["goodput_rps"])
        for key, ref in (("over_worst_fixed", worst), ("over_best_fixed", best)):
            out[key] = (live["goodput_rps"] / ref["goodput_rps"] if ref["goodput_rps"]
                        else None)
        out["best_fixed"], out["worst_fixed"] = best["setup"], worst["setup"]
        out["target_over_worst_1_1"] = (out["over_worst_fixed"] is not None
                                        and out["over_worst_fixed"] >= 1.1)
        out["target_over_best_0_97"] = (out["over_best_fixed"] is not None
                                        and out["over_best_fixed"] >= 0.97)
        out["switches"] = live.get("tuner", {}).get("switch_count")
    return out


def _ratios(summary: dict, label: str) -> str:
    w, b = summary["over_worst_fixed"], summary["over_best_fixed"]
    return (f"{label}: {w if w is None else f'{w:.2f}'}x the worst fixed layout "
            f"({summary['worst_fixed']}; target >= 1.1), "
            f"{b if b is None else f'{b:.2f}'}x the best ({summary['best_fixed']}; "
            f"target >= 0.97), {summary['switches']} switches")


def table(results: list[dict], summary: dict) -> str:
    names = [p["phase"] for p in results[0]["phases"]] if results else []
    lines = [f"{'setup':<12} {'round':>5} {'goodput/s':>9} {'attain':>7} {'failed':>6}  "
             + "  ".join(f"{n[:14]:>14}" for n in names)]
    for r in results:
        lines.append(f"{r['setup']:<12} {r.get('round', 0) + 1:>5} {r['goodput_rps']:>9.3f} "
                     f"{100 * r['attainment']:>6.0f}% {r['failed']:>6}  " + "  ".join(
                         f"{100 * (p['attainment'] or 0):>13.0f}%" for p in r["phases"]))
    for i, s in enumerate(summary.get("rounds", [])):
        if "over_worst_fixed" in s:
            lines.append(_ratios(s, f"round {i + 1}, live tuner"))
    if "over_worst_fixed" in summary:
        lines.append(_ratios(summary, "live tuner, all rounds pooled" if "rounds" in summary
                             else "live tuner"))
    lines.append(f"failed requests: {summary['failed_requests']}")
    for r in results:
        if r.get("speed"):
            lines.append(f"machine speed, {r['setup']} round {r.get('round', 0) + 1}: "
                         + speed_line(r["speed"]))
    for r in results:
        if "outstanding_peak" in r:
            lines.append(f"clients, {r['setup']} round {r.get('round', 0) + 1}: at most "
                         f"{r['outstanding_peak']} requests outstanding; "
                         f"{r['late_over_1s']} waited over 1 s for a client (timed from arrival)")
    for r in results:
        for p in r["phases"]:
            if p.get("errors"):
                lines.append(f"failed, {r['setup']} round {r.get('round', 0) + 1}, {p['phase']}: "
                             + ", ".join(f"{k} {v}" for k, v in p["errors"].items())
                             + "".join(f"; first {k}: {m}"
                                       for k, m in p.get("error_details", {}).items()))
    for r in results:
        if r.get("paths"):
            lines.append(f"paths, {r['setup']} round {r.get('round', 0) + 1}: "
                         + ", ".join(f"{k} {v}" for k, v in r["paths"].items()))
    for r in results:
        if "pauses" in r:
            lines.append(f"machine pauses over 2 s, {r['setup']} round {r.get('round', 0) + 1}: "
                         + (", ".join(f"{p['s']:g} s at {p['at_s']:g} s" for p in r["pauses"])
                            or "none"))
    for r in results:
        if r.get("cpu_s"):
            lines.append(f"CPU s over the trace, {r['setup']} round {r.get('round', 0) + 1}: "
                         + ", ".join(f"{k} {v:g}" for k, v in r["cpu_s"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
