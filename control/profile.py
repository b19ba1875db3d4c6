"""What this engine costs on this hardware (a profile, measured by ``baton profile``:
``baton.bench.profile``), and the cost model built on it.

Four measurements, each the median of a few repeats:

* **batched prefill**: one engine step of N prompt tokens, as many 64-token prompts (so attention is
  small and the time is the per-token work: weights, MLP, projections), N = 1 .. 1024;
  plus single long prompts up to 2048 tokens (chunked under the token budget, as the scheduler
  runs them), whose extra time over the same tokens batched is their attention.  Prompts of 16
  tokens would carry a per-prompt cost that hides attention up to ~512 tokens. The table is
  measured warm (every size once, untimed) and in rounds over the sizes, each point the median
  over them: its small rows are a decode step's per-token work too, and measured cold they came
  out above the decode grid's own batch-1 steps.
* **decode step**: B running requests of context C each, one token each, on a scattered pool
  (:meth:`baton.engine.kv_cache.BlockPool.scatter`): a pool long in service hands out blocks in
  the order requests ended, so a sequence's blocks lie all over it, and on a 2-vCPU Zen 4 a step
  of 12 requests at 768 tokens took ~25% longer than with each request's blocks side by side (4
  requests ~13%; a 2048-token prefill ~2%). The grid is measured on the fresh pool as well
  (``decode_fresh``): the profile's workers are freshly started, so the serving factor is their
  time over that. The two grids are timed in turn, three rounds, each point the median over
  them: timed one after the other, a slow minute of a 2-core VM once put the fresh grid up to
  33% above the scattered one (serving factor 0.79), and the simulator under-predicted a
  colocated pair's TPOT by a third. (With both on the fresh pool, a 1 prefill + 1 decode pair
  measured after a goodput search's 8 req/s run streamed at a median TPOT 3-50% above a fresh
  cluster's at the same rate and the simulator's, and the search's goodput came out 11-22% under
  the simulator's on an Azure conversation slice; sampled with py-spy, the two decode workers
  differed only in the attention's share of the time.)
* **KV hand-off**: real prefill and decode worker processes; the time from the prefill RPC's
  answer to the decode stream's first token (reserve, NIXL READ, lease release, commit), against
  the KV bytes.
* **serving**: B concurrent streams through a router to the real decode worker, their time per token
  against the bare engine's decode step for the same batch on a fresh pool (``serving_factor``),
  while requests of 512, 1024 and 2048 prompt tokens take the remote path in turn (prefill worker,
  KV hand-off, decode worker), so both workers are busy as near the cluster's goodput (the grid
  twice: the median of ten points). Then the prefill worker saturated: the same prompts sent by four
  clients so its queue is never empty (with two, each client's hand-off and decode left it idle
  between some prompts), each decoding 16 tokens streamed back to its client, in four windows of 24
  prompts, alternately with nothing else running and with 16 more streams through the router
  (16-token prompts, 128 tokens out: the decode worker decodes, as for the remote path). Each
  window's throughput (the wall time between its first and last prefill completions over the bare
  engine's time for the prompts completed in between) against the tokens a second streamed meanwhile
  gives a line (:func:`prefill_factors`): ``prefill_factor`` with nothing streamed and
  ``prefill_stream_factor``, its rise per token a second. A worker's steps share its core with its
  gRPC streams, detokenizing and NIXL, and the machine with the router, the clients and the other
  worker, who relay every streamed token; the factors scale every simulated step, the prefill one at
  the tokens the simulated cluster streamed in the second before. (Measured as one number while the
  decode grid's streams ran, the prefill factor came out 1.17-1.25 on a 2-core VM and the simulator
  under-predicted a 1 prefill + 1 decode pair's goodput by 17-31%; on its own it comes out 0.92-0.97
  with a rise of 0.027-0.037 per 100 tokens a second, 3-4x less than with 256-token streams that the
  decode worker prefilled as well. Timed one prompt at a time, with the queue empty, it came out
  ~1.0, and the simulator's TTFT near saturation was several times short of the measured one.)
  Since version 10 those two are ``prefill_factor_saturated`` and
  ``prefill_stream_factor_saturated``, and ``prefill_factor`` / ``prefill_stream_factor`` are a
  prompt's latency instead: prompts of irregular lengths (:data:`LONE_PROMPTS`) sent one at a
  time through the prefill worker, each after an idle gap (:data:`LONE_GAPS`), in windows
  alternately with nothing else streaming and with 16 streams (``lone_prefill``); per window
  the prompts' prefill calls (as the router times them, less their queue) over the bare
  engine's time for them, and the same line through the windows (:func:`prefill_latency_factors`).
  Near a layout's goodput most prompts find their worker idle or lightly queued, and on a
  2-vCPU VM such prompts of a Mooncake slice took 1.08-1.14x what the saturated factor charged
  (lone, after idle gaps, or queued behind one or two), while the simulator's goodputs came out
  12-23% above the measured ones (docs/routing.md, "Which requests make the plateau"). In
  the first version-10 profile (the same VM, 5 hours later) the two lines agreed within 1%
  (1.030 and 1.024 with nothing streamed), closer than either's windows (the lone ones 1.049
  and 1.012; the saturated ones of the profile before 0.918 and 0.993), and in the second (a
  fresh VM of that kind, 2026-12-06 17:48) again (0.965 and 0.963).
  Without the factors the simulator was ~10% optimistic per decode step and ~15% per prompt on a
  2-core VM, which near a TPOT SLO moved predicted goodputs by 30-50%. (Measured with the prefill
  worker idle, the decode factor came out ~4% lower: the router and clients had a core to
  themselves.) A factor of its own for the decode attention, fitted by least squares over the five
  points, came out 1.06-1.27 against 1.01-1.16 for the rest of the step in four profiles, with no
  consistent difference and no better predictions: one factor it is.
  The served grid is timed a second time in each round with the prefill worker idle
  (``served_idle``, ``serving_factor_idle``): the routers and the clients then have its core,
  and the decode worker's streams are not held up by hand-offs. On a 2-vCPU VM 64 streams of
  128-256 tokens ran at 1.27-1.32x the bare engine beside an idle prefill worker and 1.52-1.89x
  beside a busy one, and the simulator with the busy factor alone put a 1 prefill + 1 decode
  pair's TPOT in a decode-heavy phase (its prefill worker mostly idle) 5-13% above the measured
  one, at the SLO. The served grid is timed a third time in each round with the other worker
  decoding too (``served_decoding``, ``serving_factor_decoding``): it is switched to the decode
  role and the router splits twice the streams over the two workers, B each, as two colocated
  workers run a decode-heavy load, where the busy grid has the other worker prefilling. On a
  2-vCPU VM 16-64 streams of 128-256 tokens ran at 1.46-1.75x the bare engine beside a
  decoding worker against 1.28-1.63x beside a prefilling one and 1.15-1.20x beside an idle
  one (bench/served_beside.py). A decode step's factor runs from the idle one by the share of the
  time the cluster's other workers ran steps in the second before, toward the busy one for the
  prefill part of those steps and the decoding one for their decode part (by tokens)
  (:meth:`CostModel.decode_factor`); a version-7 profile, without the decoding grid, takes the
  busy factor for both, and a version-6 one, without the idle grid either, one factor for all.
  Those grids stop at 16 streams, where a decode worker near a layout's goodput runs up to
  19-30 at once (the validation's Mooncake slice, simulated), or more: on a 2-vCPU VM the
  factor beside a busy or a decoding worker was flat to 12-16 streams and rose about 0.004 a
  stream past them, to 1.27-1.28 at 64 (flat beside an idle one) (bench/served_beside.py).
  Each round also times :data:`SERVED_MANY` in the three conditions (``served_many``, each
  row's ``beside``), and the rise per stream past :data:`STREAM_SLOPE_ABOVE` beside a busy or a
  decoding worker over that condition's factor is ``serving_stream_slope``, added to a decode
  step's factor times the others' busy share; a version-8 profile has none.

:class:`CostModel` turns a profile into step times for any batch::

    step(prefill chunks, decode contexts) = tok(P + D)                  per-token work, interpolated
                                          + attn_prefill * sum(n * ctx) each chunk's attention pairs
                                          + per_seq * D                 each decode's own overheads
                                          + attn_decode * sum(ctx)      each decode's context
                                          + decode_offset  (P = 0)      a step of decodes alone

where P is the batch's prompt tokens, D its decodes, ``tok`` is interpolated from the batched
prefill table and the other coefficients are least-squares fits of what is left; the whole is
multiplied by the two factors weighed by the step's tokens:
``(P * (prefill_factor + prefill_stream_factor * streamed tokens/s) + D * decode_factor)
/ (P + D)``, ``decode_factor`` from ``serving_factor_idle`` toward ``serving_factor`` (the
other workers prefilling) and ``serving_factor_decoding`` (decoding) by their busy shares,
plus ``serving_stream_slope * max(0, D - STREAM_SLOPE_ABOVE) * busy share``.

``decode_offset`` (version 11) is what a step of decodes alone costs beside the table's rows,
which are prompt steps: without it the decode grid's steps were what ``tok`` left over, and in
a profile whose table ran slow (a 2-vCPU VM, 2026-12-07 00:14: its 1-16-token rows 28-43%
above the two profiles before it, the 1,024-token row 8-9%) the model put the grid's batch-1
and batch-4 steps 19-36% above their measured times, and per_seq and attn_decode absorbed the
rest (attn_decode 0); with it every profile's grid came out within 8% of the model (the seven
version-9 and -10 profiles of bench/results, 2026-12-04 .. 07). The serving factors are fitted
over the same model, so they move with it: a profile of version 10 or older reads without the
offset, and ``baton profile --refit`` fits both again from its rows.
"""

from __future__ import annotations

import bisect
import calendar
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

# 2: the prefill factor; 3: from throughput under a queue; 4: measured on its own; 5: decode
# steps on a scattered pool; 6: the batched prefill table measured warm, in rounds; 7: the
# served grid with the prefill worker idle as well (``serving_factor_idle``); 8: and with the
# other worker decoding (``serving_factor_decoding``); 9: past 16 streams as well
# (``served_many``, ``serving_stream_slope``); 10: the prefill factors a lone prompt's latency
# (``lone_prefill``), the saturated worker's throughput kept as ``prefill_factor_saturated``;
# 11: a step of decodes alone with an offset of its own (:func:`_fit_decode`), the serving
# factors over that model (``baton profile --refit`` makes one of an older profile's rows)
VERSION = 11
# a version-6 profile reads as one whose decode factor is the same idle, busy or decoding; a
# version-7 one as one whose decoding factor is its busy one; a version-8 one as one whose
# factor does not rise with the streams; a version-9 one or older as one whose prefill factors
# are the saturated worker's throughput (``prefill_factor_saturated`` None); a version-10 one
# or older as one whose decode steps have no offset (its factors were fitted without one)
READS = (6, 7, 8, 9, 10, 11)
DECODE_OFFSET_SINCE = 11
PREFILL_TOKENS = (1, 4, 16, 32, 64, 128, 256, 512, 1024)
PREFILL_PROMPT = 64  # tokens per prompt of the batched measurement
PREFILL_ROUNDS = 3  # the table's sizes in turn, each point the median over the rounds
LONG_PROMPTS = (256, 512, 1024, 2048)
# per context length, the decode batches measured (largest first: one prefill, then shrink)
DECODE_GRID = {128: (64, 16, 4, 1), 768: (12, 4, 1)}
DECODE_ROUNDS = 3  # the fresh and the scattered grid in turn, each point the median of these
HANDOFF_TOKENS = (64, 256, 1024)
# (context, concurrent streams) on a real worker: short and long contexts, small and large
# batches (the ratio moves by ±5% from one to the next; the median of five is steadier)
SERVED = ((128, 16), (384, 8), (768, 4), (768, 12), (1536, 8))
# (context, streams per decoding worker) past the grid, timed in the same three conditions in
# each round: the factor's rise with the streams (56: a decode worker's max_num_seqs of 64
# holds them beside the busy clients' hand-offs)
SERVED_MANY = ((256, 32), (256, 56))
# the streams past which the rise is counted: the grid's largest batches (16) and the point
# its medians sit near, where bench/served_beside.py found the factor still flat
STREAM_SLOPE_ABOVE = 14
SERVED_ROUNDS = 2  # the grid twice, the median of ten: one point moved 1.16 -> 1.63 between
# two profiles on a 2-core VM, and the median of five 1.15 -> 1.29
SERVED_TOKENS = (12, 36)  # the window of each stream timed: every stream decoding by then
BUSY_PROMPTS = (512, 1024, 2048)  # the prefill worker's prompts meanwhile, in turn
BUSY_CLIENTS = 4  # clients sending them: the prefill worker's queue is never empty
BUSY_OUTPUT = 16  # tokens each of them decodes and streams back, for the prefill factor
SATURATED_PROMPTS = 24  # prompts timed per window of the prefill factor (~25 s on a 2-core VM)
# the windows' other streams through the router, in turn (none, then as many as the largest
# served batch): the prefill factor's rise with the tokens streamed meanwhile
PREFILL_STREAMS = (0, 16, 0, 16)  # ~490 tokens a second streamed on a 2-core VM
STREAM_OUTPUT = 128  # tokens each of those streams decodes before the next one starts
# their prompts' tokens: short, so the decode worker decodes as it does for the remote path
# (with 256-token prompts prefilled on it as well, the rise came out 3-4x as steep, and the
# simulator under-predicted a Mooncake slice's 1P+1D goodput by 30%)
STREAM_PROMPT = 16
# the prefill factors' prompts, one at a time (version 10): irregular lengths across the
# scheduler's chunks, each sent after one of the idle gaps (seconds, in turn), in windows of
# LONE_STREAMS other streams (none, 16, in turn); LONE_ROUNDS rounds (--repeats 1: one)
LONE_PROMPTS = (143, 389, 611, 877, 1213, 1601)
LONE_GAPS = (0.25, 1.5)
LONE_STREAMS = (0, 16)
LONE_ROUNDS = 2
# what a sampled request's row adds to a decode step over a greedy one, per filter of the
# sampler (engine/sampler.py), each timed with the ones before it in force: temperature
# alone, then each of the others on top of it; a request pays the sum of those it uses (the
# router records them: services/router/workload_log.py). Decode steps of SAMPLING_BATCH
# streams at context 128, all greedy or all at one setting, in turn, DECODE_ROUNDS times
SAMPLING = {"temperature": {"temperature": 1.0}, "top_k": {"temperature": 1.0, "top_k": 50},
            "min_p": {"temperature": 1.0, "min_p": 0.05},
            "top_p": {"temperature": 1.0, "top_p": 0.95}}
SAMPLING_BATCH = 16
SAMPLING_CONTEXT = 128


# Profile.table_vs_grid: of the 20 version-6+ profiles in bench/results, 17 agree within 10%,
# 2 differ by more than this (2026-12-03 06:15: -17%; 2026-12-07 00:14: +23%)
TABLE_GRID_TOLERANCE = 0.15
STAMP = "%Y-%m-%dT%H:%M:%SZ"  # UTC, ISO 8601: `measured_at`, and each check's `at`


def utc_stamp() -> str:
    """Now, as :data:`STAMP` writes it."""
    return time.strftime(STAMP, time.gmtime())


@dataclass
class Profile:
    """Measured costs of one engine configuration on one machine (seconds, bytes)."""

    model: str
    dtype: str
    threads: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_blocks: int
    kv_bytes_per_token: int
    prefill: list[dict] = field(default_factory=list)  # {tokens, requests, s}
    prefill_long: list[dict] = field(default_factory=list)  # {tokens, s}
    decode: list[dict] = field(default_factory=list)  # {batch, context, s}, scattered pool
    decode_fresh: list[dict] = field(default_factory=list)  # the same on a fresh pool
    handoff: list[dict] = field(default_factory=list)  # {tokens, bytes, s}
    router_s: float = 0.004  # router work + two gRPC hops per request (bench/router_latency.py)
    neighbors: list[int] = field(default_factory=list)  # cores kept busy while measuring
    served: list[dict] = field(default_factory=list)  # {batch, context, s, model_s}
    serving_factor: float = 1.0  # a serving decode worker's step over the bare engine's
    # the same with the other worker idle (None: not measured, as busy); the grid {batch, ...}
    served_idle: list[dict] = field(default_factory=list)
    serving_factor_idle: float | None = None
    # the same with the other worker decoding B streams too (None: not measured, as busy)
    served_decoding: list[dict] = field(default_factory=list)
    serving_factor_decoding: float | None = None
    # SERVED_MANY in the three conditions, {batch, context, s, model_s, beside: idle | busy |
    # decoding}; the rise of the busy and the decoding factor per stream past
    # STREAM_SLOPE_ABOVE (0: not measured, a version-8 profile)
    served_many: list[dict] = field(default_factory=list)
    serving_stream_slope: float = 0.0
    served_prefill: list[dict] = field(default_factory=list)  # {tokens, s, model_s}
    # lone prompts through the prefill worker (version 10): {tokens, s, queue_s, gap, streams,
    # streamed_tps, model_s}
    lone_prefill: list[dict] = field(default_factory=list)
    prefill_factor: float = 1.0  # a serving prefill worker's prompt over the bare engine's
    # its rise per token a second streamed to clients meanwhile (router and clients share cores)
    prefill_stream_factor: float = 0.0
    # the two as the saturated worker's throughput (``served_prefill``) where the two above are
    # the lone prompts' latency (version 10); None in a profile whose factors are the throughput
    prefill_factor_saturated: float | None = None
    prefill_stream_factor_saturated: float | None = None
    # the two prefill factors' scale for prompts a decode worker prefills itself (the local
    # path); 1 in a measured profile (its prefill factors are a prefill worker's), set by the
    # live calibration on a window that measured the local path only (control/calibrate.py)
    local_prefill_scale: float = 1.0
    # KV tiers: loading blocks back into the pool, {tier, blocks, bytes, s} (kv_tiers.TierStore)
    tier_load: list[dict] = field(default_factory=list)
    machine: dict = field(default_factory=dict)
    device: str = "cpu"  # where it was measured (`baton profile --device`)
    tensor_parallel_size: int = 1  # ranks of the worker measured (`--tensor-parallel-size`)
    # the measured engine's model fingerprint (architecture, weights, dtype, block size, KV
    # layout, device kind: what the workers register) and the model's name; "" in a profile
    # from before they were recorded, which the live tuner cannot check against its workers
    fingerprint: str = ""
    model_name: str = ""
    # seconds a sampled row adds to a step, per sampler filter (:data:`SAMPLING`); {} in a
    # profile from before they were measured: sampled requests simulated at greedy's cost
    sampling: dict = field(default_factory=dict)
    # the serving checks this profile was scaled by (`baton profile --check FILE --serving
    # --out NEW`), oldest first: {at, source, decode_ratio, prefill_ratio}; [] as measured
    checked: list[dict] = field(default_factory=list)
    # when `baton profile` finished measuring it (UTC, ISO 8601); "" in a profile from before
    # that was recorded
    measured_at: str = ""
    version: int = VERSION

    def factors_beside(self) -> dict[str, float | None]:
        """The decode serving factor by what the other worker did meanwhile (the served grid's
        three conditions; None where the profile did not measure one)."""
        return {"idle": self.serving_factor_idle, "busy": self.serving_factor,
                "decoding": self.serving_factor_decoding}

    def age(self, now: float | None = None) -> str:
        """When it was measured and when a serving check last scaled it, with how long ago
        (`baton tune` says it: a shared VM's speed drifts by tens of percent within hours)."""
        def ago(stamp: str) -> str:
            try:
                t = calendar.timegm(time.strptime(stamp, STAMP))
            except ValueError:
                return stamp
            h = ((time.time() if now is None else now) - t) / 3600
            return f"{stamp}, {h:.1f} h ago" if h < 48 else f"{stamp}, {h / 24:.0f} days ago"

        said = f"measured {ago(self.measured_at)}" if self.measured_at else \
            "measured at a time it does not record"
        if self.checked:
            c = self.checked[-1]
            return (f"{said}; scaled by a serving check {ago(c['at'])} (decode "
                    f"x{c['decode_ratio']:.3f}, prefill x{c['prefill_ratio']:.3f}"
                    + (f", its rise with streaming x{c['prefill_stream_ratio']:.3f}"
                       if "prefill_stream_ratio" in c else "")
                    + (f", decode beside a decoding worker x{c['decode_ratio_decoding']:.3f}"
                       if "decode_ratio_decoding" in c else "") + ")")
        return (f"{said}; `baton profile --check FILE --serving --out NEW` brings it to this "
                "machine's speed now in ~5 minutes")

    def table_vs_grid(self) -> str | None:
        """Where the prefill table's 1-token step and the decode grid's batch-1 step at its
        shortest context differ by more than :data:`TABLE_GRID_TOLERANCE`, what to say of it;
        None where they agree, the profile lacks either row, or it was not measured on a CPU.
        On the CPU engine both are one engine step of one token (the same matmuls; their
        attention kernels differ, over a few positions), so a gap between them is the
        machine's speed moving between the two measurements, and the model fitted on both is
        wrong by it somewhere (before version 11 it went into every decode step: the
        2026-12-07 00:14 profile read 31.7 ms against 25.7 ms, +23%, and its runs' Mooncake
        colocated predictions came 18-29% under the measured goodput). On a GPU decode steps
        replay CUDA graphs and prompt steps do not: no check. `baton profile` and `baton
        tune` say it."""
        one = [r["s"] for r in self.prefill if r["tokens"] == 1 and r.get("requests", 1) == 1]
        ones = [r for r in self.decode if r["batch"] == 1]
        if not one or not ones or self.device.split(":")[0] != "cpu":
            return None
        short = min(ones, key=lambda r: r["context"])
        gap = one[0] / short["s"] - 1
        if abs(gap) <= TABLE_GRID_TOLERANCE:
            return None
        return (f"its prefill table's 1-token step ({one[0] * 1e3:.1f} ms) and its decode "
                f"grid's batch-1 step at context {short['context']} ({short['s'] * 1e3:.1f} ms) "
                f"differ by {gap:+.0%}: the machine's speed moved between the two, and the cost "
                "model fitted on both is wrong by it; measure again on a quiet machine")

    @property
    def processor(self) -> str:
        """What it was measured on, named as workers register theirs
        (:func:`baton.engine.config.processor`); "" where its machine does not say."""
        m = self.machine
        if m.get("processor") is not None:
            return m["processor"]
        if self.device.split(":")[0] == "cuda":  # before the profile named it: GPU 0's name
            return m.get("gpu", "")
        from baton.engine.config import cpu_processor

        return cpu_processor(m["cpu"], m.get("cpu_flags", [])) if m.get("cpu") else ""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ProfileError(f"cannot read profile {path}: {e}") from None
        if d.get("version") not in READS:
            raise ProfileError(f"profile {path} has version {d.get('version')!r}, this Baton "
                               f"reads versions {', '.join(map(str, READS))}: run "
                               "`baton profile` again")
        try:
            return cls(**d)
        except TypeError as e:
            raise ProfileError(f"profile {path} is malformed: {e}") from None


class ProfileError(ValueError):
    pass


# ---- the cost model ------------------------------------------------------------------------------


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (sorted xs), extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _fit_through_origin(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares k for y = k x, never negative."""
    if not any(xs):
        return 0.0
    if len(xs) == 1:
        return max(0.0, ys[0] / xs[0])
    return max(0.0, statistics.linear_regression(xs, ys, proportional=True).slope)


def _fit2(xs: Sequence[tuple[float, float]], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (a, b) >= 0 for y = a x0 + b x1 (2x2 normal equations; a coefficient that
    would come out negative is pinned at 0 and the other refitted alone)."""
    s00 = sum(x[0] * x[0] for x in xs)
    s01 = sum(x[0] * x[1] for x in xs)
    s11 = sum(x[1] * x[1] for x in xs)
    t0 = sum(x[0] * y for x, y in zip(xs, ys))
    t1 = sum(x[1] * y for x, y in zip(xs, ys))
    det = s00 * s11 - s01 * s01
    if det > 0:
        a, b = (t0 * s11 - t1 * s01) / det, (t1 * s00 - t0 * s01) / det
        if a >= 0 and b >= 0:
            return a, b
    a, b = _fit_through_origin([x[0] for x in xs], ys), _fit_through_origin([x[1] for x in xs], ys)
    err_a = sum((y - a * x[0]) ** 2 for x, y in zip(xs, ys))
    err_b = sum((y - b * x[1]) ** 2 for x, y in zip(xs, ys))
    return (a, 0.0) if err_a <= err_b else (0.0, b)


def _fit_decode(xs: Sequence[tuple[float, float]], ys: Sequence[float]
                ) -> tuple[float, float, float]:
    """Least squares (offset, a, b), a and b >= 0, for y = offset + a x0 + b x1: the decode
    grid's steps over the batched prefill table's per-token work. The offset is what a step of
    decodes alone does not pay of the table's (its rows are prompt steps) or pays beside it,
    either sign; the smallest squared error over the fits whose a and b are not negative (a
    coefficient pinned at 0 where it would be; the offset alone always fits). Without two
    distinct rows, no offset."""
    if len(set(xs)) < 2:
        return (0.0, *_fit2(xs, ys))
    best = (float("inf"), (0.0, 0.0, 0.0))
    for keep in ((0, 1), (0,), (1,), ()):
        cols = [[1.0] * len(xs)] + [[x[k] for x in xs] for k in keep]
        coef = _lstsq(cols, ys)
        if coef is None or any(c < 0 for c in coef[1:]):
            continue
        full = [coef[0], 0.0, 0.0]
        for k, c in zip(keep, coef[1:]):
            full[1 + k] = c
        err = sum((y - full[0] - full[1] * x[0] - full[2] * x[1]) ** 2 for x, y in zip(xs, ys))
        if err < best[0]:
            best = (err, (full[0], full[1], full[2]))
    return best[1]


def _lstsq(cols: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Least-squares coefficients of ``ys`` on the columns ``cols`` (normal equations, Gaussian
    elimination); None where they are singular."""
    n = len(cols)
    a = [[sum(u * v for u, v in zip(cols[i], cols[j])) for j in range(n)]
         + [sum(u * y for u, y in zip(cols[i], ys))] for i in range(n)]
    for i in range(n):
        piv = max(range(i, n), key=lambda r: abs(a[r][i]))
        if abs(a[piv][i]) < 1e-12 * max(1.0, max(abs(v) for v in a[piv][:n])):
            return None
        a[i], a[piv] = a[piv], a[i]
        for r in range(n):
            if r != i:
                f = a[r][i] / a[i][i]
                a[r] = [u - f * v for u, v in zip(a[r], a[i])]
    return [a[i][n] / a[i][i] for i in range(n)]


def _pairs(k: int, done: int) -> float:
    """Attention (query, key) pairs of a prompt chunk of ``k`` tokens after ``done`` computed."""
    return k * (done + (k + 1) / 2)


def _chunks(n: int, budget: int) -> list[tuple[int, int]]:
    """A lone ``n``-token prompt as the scheduler runs it: (tokens, computed before) per step."""
    return [(min(budget, n - done), done) for done in range(0, n, budget)]


class CostModel:
    """Step and hand-off times from a :class:`Profile` (see the module docstring)."""

    def __init__(self, p: Profile) -> None:
        if not p.prefill or not p.decode:
            raise ProfileError("the profile has no prefill or decode measurements")
        rows = sorted((r["tokens"], r["s"]) for r in p.prefill)
        self._tx, self._ty = [r[0] for r in rows], [r[1] for r in rows]
        self.budget = budget = p.max_num_batched_tokens
        chunked = [(r, _chunks(r["tokens"], budget)) for r in p.prefill_long]
        self.attn_prefill = _fit_through_origin(
            [sum(_pairs(k, done) for k, done in cs) for _, cs in chunked],
            [r["s"] - sum(self.tok(k) for k, _ in cs) for r, cs in chunked])
        grid = ([(r["batch"], r["batch"] * r["context"]) for r in p.decode],
                [r["s"] - self.tok(r["batch"]) for r in p.decode])
        fit = _fit_decode(*grid) if p.version >= DECODE_OFFSET_SINCE else None
        # an offset that leaves a step of decodes alone at or under 0 is no engine's: none then.
        # Every batch up to the grid's largest and max_num_seqs, at the grid's shortest context
        # (longer ones cost more): `tok` interpolates the prefill table, which on a noisy
        # machine need not rise with the batch, so batch 1 alone does not tell
        ctx = min(r["context"] for r in p.decode)
        top = max(p.max_num_seqs, *(r["batch"] for r in p.decode))
        if fit is not None and all(self.tok(b) + fit[0] + fit[1] * b + fit[2] * b * ctx > 0
                                   for b in range(1, top + 1)):
            self.decode_offset, self.per_seq, self.attn_decode = fit
        else:
            self.decode_offset, (self.per_seq, self.attn_decode) = 0.0, _fit2(*grid)
        self.handoff_per_byte, self.handoff_fixed = 0.0, 0.0
        xs, ys = [r["bytes"] for r in p.handoff], [r["s"] for r in p.handoff]
        if len(set(xs)) > 1:  # handoff = fixed + per_byte * bytes, least squares
            fit = statistics.linear_regression(xs, ys)
            self.handoff_per_byte = max(0.0, fit.slope)
            self.handoff_fixed = max(0.0, statistics.fmean(ys) - self.handoff_per_byte
                                     * statistics.fmean(xs))
        elif ys:
            self.handoff_fixed = statistics.fmean(ys)
        self.kv_bytes_per_token = p.kv_bytes_per_token
        self.serving_factor, self.prefill_factor = p.serving_factor, p.prefill_factor
        self.serving_factor_idle = (p.serving_factor if p.serving_factor_idle is None
                                    else p.serving_factor_idle)
        self.serving_factor_decoding = (p.serving_factor if p.serving_factor_decoding is None
                                        else p.serving_factor_decoding)
        self.stream_slope, self.stream_above = p.serving_stream_slope, STREAM_SLOPE_ABOVE
        # whether a decode step's factor depends on the others' busy share
        self.decode_factors_differ = (self.serving_factor_idle != self.serving_factor
                                      or self.serving_factor_decoding != self.serving_factor
                                      or self.stream_slope != 0.0)
        self.prefill_stream_factor = p.prefill_stream_factor
        self.local_prefill_scale = p.local_prefill_scale
        # the spread of a step's time about the model's (the sd of its log; 0: every step as
        # the model says). A simulation draws each step's factor from a lognormal of mean 1
        # (:meth:`baton.control.sim.Sim.noise`): queues near a pool's capacity grow with it
        self.step_noise = 0.0
        self._tier_block_s = {r["tier"]: r["s"] / r["blocks"] for r in p.tier_load
                              if r.get("blocks")}
        self._sample_s = {k: float(v) for k, v in p.sampling.items() if v}

    @property
    def samples(self) -> bool:
        """Whether a sampled row costs anything here (the profile timed the sampler)."""
        return bool(self._sample_s)

    def sample_row(self, filters: Sequence[str]) -> float:
        """What one row sampled with ``filters`` (the router's names, :data:`SAMPLING`) adds to
        the bare engine's step; 0 for a greedy row, and for a filter the profile did not
        measure."""
        return sum(self._sample_s.get(f, 0.0) for f in filters)

    def tok(self, n: int) -> float:
        """Per-token work of a step that runs ``n`` tokens (no attention)."""
        return _interp(self._tx, self._ty, n) if n > 0 else 0.0

    def step(self, chunks: Sequence[tuple[int, int]], decode_ctxs: Sequence[int],
             streamed_tps: float = 0.0, local: bool = False, others_busy: float = 1.0,
             others_decoding: float = 0.0, sampled_s: float = 0.0) -> float:
        """One engine step: ``chunks`` = (new tokens, tokens already computed) per prefilling
        request, ``decode_ctxs`` = context length per decoding request, ``streamed_tps`` the
        tokens a second the cluster streams to its clients meanwhile; ``local``: a decode
        worker's step (its prompts at ``local_prefill_scale``); ``others_busy``: the share of
        the time the other workers ran steps meanwhile (0 idle .. 1 busy, as the profile's
        served grid), ``others_decoding`` the decode part of it, between the decode factors
        (:meth:`decode_factor`); ``sampled_s``: what its sampled rows add to the bare engine's
        step (:meth:`sample_row`)."""
        p, d = sum(c[0] for c in chunks), len(decode_ctxs)
        if not p + d:
            return 0.0
        pairs = sum(_pairs(k, done) for k, done in chunks)
        prefill = self.prefill_factor + self.prefill_stream_factor * streamed_tps
        if local:
            prefill *= self.local_prefill_scale
        decode = self.decode_factor(others_busy, others_decoding, d)
        factor = (p * prefill + d * decode) / (p + d)
        return factor * (self.engine_step(p + d, pairs, decode_ctxs) + sampled_s)

    def decode_factor(self, others_busy: float = 1.0, others_decoding: float = 0.0,
                      streams: int = 0) -> float:
        """A serving worker's decode step over the bare engine's, with the other workers busy
        ``others_busy`` of the time (0 .. 1), ``others_decoding`` of it (at most
        ``others_busy``) decoding and the rest prefilling, for a step of ``streams`` decodes
        (the rise past :data:`STREAM_SLOPE_ABOVE`, by the busy share)."""
        share = min(1.0, max(0.0, others_busy))
        dec = min(share, max(0.0, others_decoding))
        idle = self.serving_factor_idle
        return (idle + (self.serving_factor - idle) * (share - dec)
                + (self.serving_factor_decoding - idle) * dec
                + self.stream_slope * max(0, streams - self.stream_above) * share)

    def engine_step(self, n: int, pairs: float, decode_ctxs: Sequence[int]) -> float:
        """The bare engine's step (in this process, nothing else to do): ``n`` tokens,
        ``pairs`` prompt attention pairs, decodes at ``decode_ctxs``."""
        d = len(decode_ctxs)
        return max(0.0, self.tok(n) + self.attn_prefill * pairs + self.per_seq * d
                   + self.attn_decode * sum(decode_ctxs)
                   + (self.decode_offset if d and n == d else 0.0))

    def engine_prompt(self, n: int) -> float:
        """The bare engine's time for a lone ``n``-token prompt, chunked as the scheduler runs
        it."""
        return sum(self.engine_step(k, _pairs(k, done), [])
                   for k, done in _chunks(n, self.budget))

    def tier_load_s(self, tier: str) -> float:
        """Loading one block back into the pool from ``tier`` (host, disk); 0 unmeasured."""
        return self._tier_block_s.get(tier, 0.0)

    def handoff(self, tokens: int) -> float:
        return self.handoff_fixed + self.handoff_per_byte * tokens * self.kv_bytes_per_token

    def summary(self) -> dict:
        return {"serving_factor": self.serving_factor,
                "serving_factor_idle": self.serving_factor_idle,
                "serving_factor_decoding": self.serving_factor_decoding,
                "serving_stream_slope": self.stream_slope,
                "prefill_factor": self.prefill_factor,
                "prefill_stream_factor_per_tps": self.prefill_stream_factor,
                "attn_prefill_s_per_pair": self.attn_prefill,
                "decode_offset_s": self.decode_offset,
                "decode_s_per_sequence": self.per_seq,
                "attn_decode_s_per_context_token": self.attn_decode,
                "handoff_fixed_s": self.handoff_fixed,
                "handoff_s_per_mib": self.handoff_per_byte * (1 << 20)}


# ---- measuring -----------------------------------------------------------------------------------


def prefill_throughput_factor(rows: Sequence[dict], engine_prompt: Callable[[int], float]
                              ) -> float | None:
    """A queued prefill worker's wall time between its first and last prefill completions in
    ``rows`` ({tokens, end}) over the bare engine's time for the prompts completed after the
    first; None with fewer than three completions."""
    done = sorted(rows, key=lambda r: r["end"])
    if len(done) < 3:
        return None
    work = sum(engine_prompt(r["tokens"]) for r in done[1:])
    return (done[-1]["end"] - done[0]["end"]) / work


def prefill_windows(rows: Sequence[dict]) -> list[list[dict]]:
    """``rows`` ({tokens, end, streams, ...}) in their windows: consecutive rows of one
    ``streams`` count."""
    windows: list[list[dict]] = []
    for r in rows:
        if not windows or windows[-1][0].get("streams") != r.get("streams"):
            windows.append([])
        windows[-1].append(r)
    return windows


def prefill_factors(rows: Sequence[dict], engine_prompt: Callable[[int], float]
                    ) -> tuple[float, float] | None:
    """(factor with nothing streamed, its rise per token a second streamed): a least-squares
    line through the throughput factor of each window of ``rows`` ({tokens, end, streams,
    streamed_tps}: the windows are told apart by ``streams``, in order), the rise never
    negative; None without a window of three completions."""
    return _factor_line(rows, lambda w: prefill_throughput_factor(w, engine_prompt))


def prefill_latency_factor(rows: Sequence[dict], engine_prompt: Callable[[int], float]
                           ) -> float | None:
    """Lone prompts' prefill calls ({tokens, s}) over the bare engine's time for them, summed
    (the longer prompts weigh more, as they weigh in a TTFT); None without rows."""
    work = sum(engine_prompt(r["tokens"]) for r in rows)
    return sum(r["s"] for r in rows) / work if rows and work > 0 else None


def prefill_latency_factors(rows: Sequence[dict], engine_prompt: Callable[[int], float]
                            ) -> tuple[float, float] | None:
    """:func:`prefill_factors` for lone prompts ({tokens, s, streams, streamed_tps}, windows
    told apart by ``streams``): the line through each window's :func:`prefill_latency_factor`
    against the tokens a second streamed meanwhile; None without rows."""
    return _factor_line(rows, lambda w: prefill_latency_factor(w, engine_prompt))


def _factor_line(rows: Sequence[dict], factor: Callable[[list[dict]], float | None]
                 ) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line through each window's ``factor`` against
    its mean ``streamed_tps``: the mean and no slope where the windows streamed alike or the
    factor fell with streaming; None where no window has a factor."""
    points = [(statistics.fmean(r.get("streamed_tps", 0.0) for r in w), f)
              for w in prefill_windows(rows) if (f := factor(w)) is not None]
    if not points:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if len(set(xs)) < 2:
        return statistics.fmean(ys), 0.0
    fit = statistics.linear_regression(xs, ys)
    if fit.slope <= 0:
        return statistics.fmean(ys), 0.0
    return fit.intercept, fit.slope


def tier_weights(p: Profile) -> dict[str, float]:
    """Per KV tier, the share of a block's prefill time that loading it from the tier saves:
    ``1 - load time per token / prefill time per token`` (a 1,024-token prompt's, prefill factor
    included), clipped to [0, 1]. The router's prefix scorer values a tier's blocks by it."""
    if not p.tier_load or not p.prefill_long:
        return {}
    model = CostModel(p)
    prefill_per_token = model.engine_prompt(1024) * p.prefill_factor / 1024
    out = {}
    for row in p.tier_load:
        per_token = row["s"] / (row["blocks"] * p.block_size)
        out[row["tier"]] = round(min(1.0, max(0.0, 1 - per_token / prefill_per_token)), 4)
    return out


def default_path() -> Path:
    from baton import cache_dir

    return cache_dir() / "profile.json"
