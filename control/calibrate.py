"""A profile's serving factors corrected by what the cluster measured, for `baton tune --live`.

A profile's bare-engine tables hold from one hour to the next on a shared VM, but its serving
factors (a serving worker's step over the bare engine's) moved 4-8% an hour on a 2-core VM, and
validations on a profile measured the evening before predicted goodput up to 16% off, against
within 4% on one measured within the hour. The live tuner has what a profile lacks: the router's
window records every finished request's TPOT and its first token's phases. So it simulates the
layout the cluster runs now on the window's own arrivals and scales the profile's factors until
the simulated means (each side's middle 80%: a GC pause or a cold start is not the machine's
speed) match the measured ones, over the requests finished in both:

* the decode factor (``serving_factor``): TPOT;
* the prefill factors (``prefill_factor`` and its rise with the tokens streamed,
  ``prefill_stream_factor``): the first token's compute on the remote path (the prefill
  worker's: the router's ``prefill`` phase), else on the local path (the decode worker's: the
  first token less the router's waits, routing and the worker's queue). With neither (fewer
  than :data:`MIN_SAMPLES` requests), the profile's prefill factors are kept, and it says so.
  A remote fit scales both factors, as the profile's are a prefill worker's. A local fit scales
  the local path's alone (``local_prefill_scale``): a decode worker's prompts share its steps
  with its streams, and what they cost there does not say what a prefill worker's cost. (From
  the colocated windows of nine validation runs, 1P+1D came -9% to +12% off its measured
  goodput with both factors scaled, 0% to +5% with the local path's alone: docs/routing.md.)
  The worker's queue counts from the request's arrival at the worker, the step running then
  included (``EngineLoop.submit``), as the simulator's does: that step is not prefill compute.

The two are fitted together, by Newton's method on the logs (:func:`calibrate`): a slower decode
step holds the prefill worker's streams longer, and two colocated workers run prompts and
decodes in the same steps, so neither mean answers to its own factor alone. Near overload the
means move with the queues more than with the factors; when no fit comes within
:data:`TOLERANCE`, nothing is applied. A correction outside ``bounds`` is refused (the profile is
from another machine or setup, or the window is not the cluster's: re-profile), never applied
clipped.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from baton.control.profile import Profile, utc_stamp
from baton.control.sim import Knobs, Layout, simulate

MIN_SAMPLES = 10  # requests per mean: fewer leave that factor as the profile has it
BOUNDS = (0.5, 2.0)  # the largest correction applied, either way
ROUNDS = 5
CONVERGED = 0.01  # every mean within 1% of the measured one: done
MAX_STEP = math.log(1.5)  # the most one round moves a factor
MIN_RESPONSE = 0.05  # a mean's response to its own factor (d log / d log) below this: none
TRIM = 0.1  # each end's share left out of a mean
TOLERANCE = 0.05  # the fit's largest gap between means past which nothing is applied
GRID = (0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4)  # each factor's scales tried when Newton fails


@dataclass(frozen=True)
class Observed:
    """One request of the window as the router measured it (None: not measured)."""

    tpot_s: float | None = None
    # the first token's compute: the prefill worker's (remote path: its Prefill call less its
    # queue) or the decode worker's (local path: the first token less the router's waits,
    # routing and the decode worker's queue)
    prefill_s: float | None = None
    path: str | None = None


def from_window(rows: Sequence[dict]) -> list[Observed | None]:
    """The router's exported window (``/v1/baton/workload`` rows, in arrival order) as
    :class:`Observed` per row; None for a request still in flight."""
    out: list[Observed | None] = []
    for r in rows:
        if r.get("in_flight"):
            out.append(None)
            continue
        path, phases = r.get("path"), r.get("phases") or {}
        if path == "remote":
            prefill = phases.get("prefill")
        elif path == "local" and r.get("ttft_s") is not None:
            prefill = r["ttft_s"] - sum(phases.values())  # its prefill and transfer are 0
        else:
            prefill = None
        out.append(Observed(r.get("tpot_s"), prefill if prefill and prefill > 0 else None,
                            path))
    return out


@dataclass
class Calibration:
    profile: Profile  # the profile with the corrected factors (the input when not applied)
    decode_ratio: float = 1.0  # the factor applied to serving_factor
    # to prefill_factor and prefill_stream_factor (remote path), or local_prefill_scale (local)
    prefill_ratio: float = 1.0
    decode_samples: int = 0
    prefill_samples: int = 0
    prefill_path: str | None = None  # whose first-token compute set the prefill factor
    rounds: int = 0
    applied: bool = False
    refused: bool = False  # a fit was made but not taken (outside TOLERANCE or ``bounds``)
    notes: list[str] = field(default_factory=list)
    # the fit's means, measured and simulated (seconds; None: too few samples)
    tpot_measured: float | None = None
    tpot_simulated: float | None = None
    prefill_measured: float | None = None
    prefill_simulated: float | None = None

    def summary(self, used: Profile | None = None) -> dict:
        """The fit, with the factors of ``used`` (the profile the look simulated with, when
        not this fit's own: :class:`Fits`)."""
        p = used or self.profile
        return {"applied": self.applied, "decode_ratio": round(self.decode_ratio, 4),
                "prefill_ratio": round(self.prefill_ratio, 4),
                "serving_factor": round(p.serving_factor, 4),
                "serving_factor_idle": (None if p.serving_factor_idle is None
                                        else round(p.serving_factor_idle, 4)),
                "serving_factor_decoding": (None if p.serving_factor_decoding is None
                                            else round(p.serving_factor_decoding, 4)),
                "serving_stream_slope": round(p.serving_stream_slope, 5),
                "prefill_factor": round(p.prefill_factor, 4),
                "local_prefill_scale": round(p.local_prefill_scale, 4),
                "decode_samples": self.decode_samples, "prefill_samples": self.prefill_samples,
                "prefill_path": self.prefill_path,
                "rounds": self.rounds, "tpot_measured_s": self.tpot_measured,
                "tpot_simulated_s": self.tpot_simulated,
                "prefill_measured_s": self.prefill_measured,
                "prefill_simulated_s": self.prefill_simulated, "notes": self.notes}

    def line(self) -> str:
        """One line for the tuner's report."""
        if not self.applied:
            return ("calibration: none (" + "; ".join(self.notes) + ")" if self.notes else
                    "calibration: none needed (the profile's factors give the window's "
                    "means within 1%)")
        parts = [f"decode x{self.decode_ratio:.3f} (mean TPOT measured "
                 f"{1000 * self.tpot_measured:.1f} ms, {self.decode_samples} requests)"
                 if self.tpot_measured else "decode kept"]
        only = ", the local path only" if self.prefill_path == "local" else ""
        parts.append(f"prefill x{self.prefill_ratio:.3f} (mean {self.prefill_path} first-"
                     f"token compute measured {1000 * self.prefill_measured:.0f} ms, "
                     f"{self.prefill_samples} requests{only})"
                     if self.prefill_measured else "prefill kept")
        return ("calibration on the live window: " + ", ".join(parts)
                + ("; " + "; ".join(self.notes) if self.notes else ""))


def scaled(p: Profile, kd: float, kp: float, path: str | None,
           kps: float | None = None, kdd: float | None = None) -> Profile:
    """``p`` with the decode factors (idle, busy, decoding, and their rise with the streams)
    scaled by ``kd`` and the prefill factors by ``kp``: a prefill worker's (the saturated
    throughput's beside them too, where a version-10 profile keeps it) and the local path's for
    a remote fit, the local path's alone for a local one. ``kps``: the prefill worker's rise
    with streaming scaled by this instead (a serving check that timed it); ``kdd``: the decode
    factor beside a decoding worker by this instead; None: by ``kp`` and ``kd``."""
    decode = {"serving_factor": p.serving_factor * kd,
              "serving_factor_idle": (None if p.serving_factor_idle is None
                                      else p.serving_factor_idle * kd),
              "serving_factor_decoding": (None if p.serving_factor_decoding is None
                                          else p.serving_factor_decoding
                                          * (kd if kdd is None else kdd)),
              "serving_stream_slope": p.serving_stream_slope * kd}
    if path == "local":
        return replace(p, **decode, local_prefill_scale=p.local_prefill_scale * kp)
    saturated = {k: None if getattr(p, k) is None else getattr(p, k) * kp
                 for k in ("prefill_factor_saturated", "prefill_stream_factor_saturated")}
    return replace(p, **decode, **saturated, prefill_factor=p.prefill_factor * kp,
                   prefill_stream_factor=p.prefill_stream_factor * (kp if kps is None else kps))


def checked(p: Profile, serving: dict, source: str, at: str | None = None) -> Profile:
    """``p`` as a serving check (`baton profile --check --serving`,
    :func:`baton.bench.profile.serving_probe`) found the machine: the decode factors scaled by
    its ``decode_ratio`` and the prefill factors by its ``prefill_ratio`` (as :func:`scaled`
    scales them for a fit on the remote path; the prefill factor's rise with streaming by its
    ``prefill_stream_ratio`` and the decode factor beside a decoding worker by its
    ``decode_ratio_decoding`` where the check timed them), the check kept in ``checked``. A
    shared VM's serving speed moves by tens of percent in hours; five minutes of checking bring
    a profile back to it, where measuring it again takes twenty. ``at``: when (default now)."""
    kd, kp = float(serving["decode_ratio"]), float(serving["prefill_ratio"])
    kps, kdd = serving.get("prefill_stream_ratio"), serving.get("decode_ratio_decoding")
    if not (kd > 0 and kp > 0 and math.isfinite(kd) and math.isfinite(kp)):
        raise ValueError(f"a serving check's ratios must be positive: decode {kd}, "
                         f"prefill {kp}")
    if kps is not None and not (kps >= 0 and math.isfinite(kps)):
        raise ValueError(f"a serving check's prefill rise ratio must be a number >= 0: {kps}")
    if kdd is not None and not (kdd > 0 and math.isfinite(kdd)):
        raise ValueError(f"a serving check's decode ratio beside a decoding worker must be "
                         f"positive: {kdd}")
    entry = {"at": at or utc_stamp(), "source": source, "decode_ratio": kd, "prefill_ratio": kp}
    if kps is not None:
        entry["prefill_stream_ratio"] = float(kps)
    if kdd is not None:
        entry["decode_ratio_decoding"] = float(kdd)
    return replace(scaled(p, kd, kp, None, None if kps is None else float(kps),
                          None if kdd is None else float(kdd)),
                   checked=[*p.checked, entry])


def _means(pairs: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(measured, simulated) trimmed means: each side's middle 80%."""
    if len(pairs) < MIN_SAMPLES:
        return None
    return _trimmed([m for m, _ in pairs]), _trimmed([s for _, s in pairs])


def _trimmed(xs: list[float]) -> float:
    xs = sorted(xs)
    k = int(len(xs) * TRIM)
    return statistics.fmean(xs[k:len(xs) - k])


@dataclass
class _Look:
    """One simulation of the window against the measurements: (measured, simulated) means."""

    tpot: tuple[float, float] | None
    prefill: tuple[float, float] | None
    prefill_path: str | None
    tpot_n: int
    prefill_n: int

    def logs(self, dims: Sequence[str]) -> list[float]:
        """log(simulated mean) per dimension in ``dims``."""
        return [math.log(getattr(self, d)[1]) for d in dims]


def _look(profile: Profile, layout: Layout, shape: Sequence[tuple],
          observed: Sequence[Observed | None], knobs: Knobs | None, kd: float, kp: float,
          path: str | None = None) -> _Look:
    done = simulate(layout, scaled(profile, kd, kp, path), shape, knobs)
    tpot = [(o.tpot_s, s.tpot) for o, s in zip(observed, done)
            if o is not None and o.tpot_s and s.tpot]
    pre: list[tuple[float, float]] = []
    for way in (path,) if path else ("remote", "local"):  # the prefill worker's first
        pre = [(o.prefill_s, s.prefill_s) for o, s in zip(observed, done)
               if o is not None and o.path == s.path == way and o.prefill_s and s.prefill_s]
        if len(pre) >= MIN_SAMPLES:
            break
    mean = _means(pre)
    return _Look(_means(tpot), mean, way if mean else None, len(tpot), len(pre))


def calibrate(profile: Profile, layout: Layout, shape: Sequence[tuple],
              observed: Sequence[Observed | None], knobs: Knobs | None = None,
              rounds: int = ROUNDS, bounds: tuple[float, float] = BOUNDS) -> Calibration:
    """``profile``'s factors scaled so that ``layout`` simulated on ``shape`` (the window's
    requests, :func:`baton.control.tune.shape`) gives ``observed``'s mean TPOT and
    first-token compute (``observed[i]`` is ``shape[i]`` as measured; means of each side's
    middle 80%).

    Newton's method on the logs: each round the means' response to each factor is measured
    by simulating it 5% higher, and the two factors move together. (Scaling each factor by its
    own ratio alone did not settle on two colocated workers near overload, whose TPOT is
    mostly the prompts' chunks in the same steps: it moved the decode factor 0.75x where the
    truth was 0.9x. Medians instead of means jumped 30% between two factors 10% apart, as a
    batch of prompts formed or split.)"""
    if len(observed) != len(shape):
        raise ValueError(f"{len(observed)} observations for {len(shape)} requests")
    cal = Calibration(profile)

    def look(x: list[float]) -> _Look:
        return _look(profile, layout, shape, observed, knobs, math.exp(x[0]), math.exp(x[1]),
                     path)

    path = None
    x = [0.0, 0.0]  # log of the decode and the prefill factor's scale
    now = first = look(x)
    path = now.prefill_path
    dims = [d for d in ("tpot", "prefill") if getattr(now, d)]
    axis = {"tpot": 0, "prefill": 1}
    best: tuple[float, list[float], _Look] = (_miss(now, dims), list(x), now)

    def keep(at: list[float], got: _Look) -> None:
        nonlocal best
        if all(getattr(got, d) for d in dims) and _miss(got, dims) < best[0]:
            best = (_miss(got, dims), list(at), got)

    for cal.rounds in range(1, rounds + 1):
        if not dims or _miss(now, dims) <= CONVERGED:
            break
        resid = [math.log(getattr(now, d)[0]) - v for d, v in zip(dims, now.logs(dims))]
        # the Jacobian of the simulated means' logs against the factors' logs
        h = math.log(1.05)
        cols = []
        for d in dims:
            x2 = list(x)
            x2[axis[d]] += h
            moved = look(x2)
            keep(x2, moved)
            if not all(getattr(moved, e) for e in dims):  # a mean lost its samples
                cols = []
                break
            cols.append([(a - b) / h for a, b in zip(moved.logs(dims), now.logs(dims))])
        step = _solve(cols, resid) if cols else None
        if step is None:  # no usable response: each factor by its own mean's ratio
            step = resid
        for d, st in zip(dims, step):
            x[axis[d]] += max(-MAX_STEP, min(MAX_STEP, st))
        nxt = look(x)
        keep(x, nxt)
        if not all(getattr(nxt, d) for d in dims):
            break
        now = nxt
    if dims and best[0] > CONVERGED:
        # Newton did not settle (near overload the means jump with the queues): the best
        # point of a grid, if better
        for g in itertools.product(*([GRID] * len(dims))):
            at = [0.0, 0.0]
            for d, k in zip(dims, g):
                at[axis[d]] = math.log(k)
            keep(at, look(at))
    miss, x, now = best
    if dims and miss > TOLERANCE:
        cal.notes.append(f"the simulated means came within {100 * miss:.0f}% of the measured "
                         f"ones at best (over {100 * TOLERANCE:.0f}%: near overload they move "
                         "with the queues, not the factors): none applied")
        cal.refused = True
        x, now = [0.0, 0.0], first
    cal.tpot_measured, cal.tpot_simulated = now.tpot or (None, None)
    cal.prefill_measured, cal.prefill_simulated = now.prefill or (None, None)
    cal.decode_samples, cal.prefill_samples = now.tpot_n, now.prefill_n
    cal.prefill_path = now.prefill_path
    kd, kp = math.exp(x[0]), math.exp(x[1])
    if not now.tpot:
        cal.notes.append(f"fewer than {MIN_SAMPLES} finished requests with a TPOT in both: "
                         "the profile's decode factor kept")
        kd = 1.0
    if not now.prefill:
        cal.notes.append(f"fewer than {MIN_SAMPLES} requests on one path in both with a "
                         "first-token compute: the profile's prefill factors kept")
        kp = 1.0
    lo, hi = bounds
    far = [f"{name} x{k:.2f}" for name, k in (("decode", kd), ("prefill", kp))
           if not lo <= k <= hi]
    if far:
        cal.notes.append(f"correction {', '.join(far)} is outside {lo:g}-{hi:g}: the profile "
                         "is not this cluster's (re-run `baton profile`); none applied")
        cal.refused = True
        return cal
    cal.decode_ratio, cal.prefill_ratio = kd, kp
    cal.applied = kd != 1.0 or kp != 1.0
    if cal.applied:
        cal.profile = scaled(profile, kd, kp, cal.prefill_path)
    return cal


def served(rows: Sequence[dict], ttft_slo: float, tpot_slo: float) -> float | None:
    """The share of the window's finished requests (``/v1/baton/workload`` rows) that met
    both SLOs; None under :data:`MIN_SAMPLES` finished."""
    done = [r for r in rows if not r.get("in_flight") and r.get("ttft_s") is not None]
    if len(done) < MIN_SAMPLES:
        return None
    met = sum(r["ttft_s"] <= ttft_slo and (r.get("tpot_s") is None or r["tpot_s"] <= tpot_slo)
              for r in done)
    return met / len(done)


@dataclass
class Fits:
    """The live windows' fits, kept across the tuner's looks, each factor from the last window
    that could fit it: the decode factor; the prefill worker's (a window with a prefill pool:
    the remote path); the local path's (a window with none). Without them a window that fits
    nothing (too few finished requests, a backlog the factors cannot explain) goes back to the
    profile as measured, and a colocated window, whose fit says nothing of a prefill worker,
    predicts the prefill pool with the profile's prefill factor even when the last
    disaggregated window had measured another; on a machine twice as fast as its profile that
    made every disaggregated layout look twice as slow to prefill.

    A window the cluster served below the SLO target is not kept (:func:`served`; the caller
    decides): near overload the fitted factors can follow the queues rather than the machine.
    Shifting-load run 11 kept one such fit (decode and local prefill x1.16, where the windows
    before had fitted 0.5-0.7) and colocated looked three times slower than it was for the rest
    of the trace. A judgment of two runs (11 and 12, docs/routing.md): part of that decode fit
    may be the real cost of large batches under a profile from another machine.

    Each is (ratio to the profile's factor, the look's time in seconds)."""

    decode: tuple[float, float] | None = None
    remote: tuple[float, float] | None = None
    local: tuple[float, float] | None = None

    def update(self, cal: Calibration, at: float) -> None:
        """Keep what ``cal`` fitted (applied, or within 1% of the profile: ratio 1)."""
        if cal.refused:
            return
        if cal.tpot_measured is not None:
            self.decode = (cal.decode_ratio, at)
        if cal.prefill_measured is not None and cal.prefill_path in ("remote", "local"):
            setattr(self, cal.prefill_path, (cal.prefill_ratio, at))

    def take(self, fit: Callable[[], Calibration], at: float, met: float | None,
             target: float, profile: Profile) -> Calibration:
        """``fit()``, kept (:meth:`update`), unless its window met the SLOs for under
        ``target`` of its finished requests (``met``, :func:`served`; None: too few to say):
        then nothing is fitted (the fit would not be kept, and on a machine near overload the
        tuner's CPU is the workers'; a decode-heavy window's fit took 3.5 s of one core) and
        the returned calibration of ``profile`` is not applied and says why."""
        if met is not None and met < target:
            return Calibration(profile, notes=[
                f"the window met the SLOs for {100 * met:.0f}% of its finished requests "
                f"(under {100 * target:.0f}%: near overload a fit follows the queues): not "
                "fitted, the last fits kept"])
        cal = fit()
        self.update(cal, at)
        return cal

    def profile(self, p: Profile) -> Profile:
        """``p`` with every kept factor: a remote fit scales every prompt (as :func:`scaled`),
        a local one sets the local path's whole scale over ``p``'s."""
        kd = self.decode[0] if self.decode else 1.0
        kr = self.remote[0] if self.remote else 1.0
        kl = self.local[0] if self.local else kr
        out = scaled(p, kd, kr, "remote")
        return replace(out, local_prefill_scale=p.local_prefill_scale * kl / kr)

    def summary(self, at: float) -> dict:
        """Each kept ratio with its age in seconds at ``at`` (None: never fitted)."""
        return {name: (None if got is None else
                       {"ratio": round(got[0], 4), "age_s": round(at - got[1], 1)})
                for name, got in (("decode", self.decode), ("remote_prefill", self.remote),
                                  ("local_prefill", self.local))}


def _miss(got: _Look, dims: Sequence[str]) -> float:
    """The largest relative gap between a simulated mean and the measured one."""
    return max((abs(getattr(got, d)[1] / getattr(got, d)[0] - 1) for d in dims), default=0.0)


def _solve(cols: list[list[float]], rhs: list[float]) -> list[float] | None:
    """x with J x = rhs, J given by its columns (1x1 or 2x2); None when J is near singular or
    a factor would make its own mean move the wrong way."""
    if len(cols) == 1:
        j = cols[0][0]
        return [rhs[0] / j] if j > MIN_RESPONSE else None
    (a, c), (b, d) = cols  # J = [[a, b], [c, d]]
    det = a * d - b * c
    if a <= MIN_RESPONSE or d <= MIN_RESPONSE or det <= MIN_RESPONSE * max(a * d, 1e-12):
        return None
    return [(d * rhs[0] - b * rhs[1]) / det, (a * rhs[1] - c * rhs[0]) / det]
