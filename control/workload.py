"""Workloads and service-level objectives, shared by the load generator (``baton.bench.loadgen``),
the simulator and ``baton tune``: a workload is a list of :class:`Req` (prompt token ids, output
length, arrival offset), from a synthetic shape or a real trace (Azure, Mooncake), on a Poisson
clock or the trace's own; a :class:`Record` is when each token of one request arrived; a request
:func:`meets` the SLOs when its TTFT and TPOT are within them; :func:`find_goodput` searches the
highest rate at which a share of requests do.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # seconds after the run's start (open loop)
    # the sampler's filters it asks for (control/profile.py SAMPLING's names; () greedy)
    sampling: tuple[str, ...] = ()


@dataclass
class Tokens:
    """Where prompt tokens come from: ids in ``[lo, hi)``, pseudo-random per ``salt``."""

    lo: int = 100
    hi: int = 10000
    salt: str = ""

    def random(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.lo, self.hi) for _ in range(n)]


def synthetic(n: int, input_len: tuple[int, int], output_len: tuple[int, int],
              tokens: Tokens, seed: int = 0) -> list[Req]:
    """Prompt and output lengths uniform in the given inclusive ranges."""
    rng = random.Random(f"{seed}/{tokens.salt}")
    return [Req(tokens.random(rng, rng.randint(*input_len)), rng.randint(*output_len))
            for _ in range(n)]


def shared_prefix(n: int, groups: int, prefix_len: int, suffix_len: tuple[int, int],
                  output_len: tuple[int, int], tokens: Tokens, seed: int = 0) -> list[Req]:
    """``groups`` system prompts of ``prefix_len`` tokens; each request takes one (in turn) and
    adds its own suffix (the multi-tenant chat pattern a prefix cache serves)."""
    rng = random.Random(f"{seed}/{tokens.salt}")
    prefixes = [tokens.random(rng, prefix_len) for _ in range(groups)]
    return [Req(prefixes[i % groups] + tokens.random(rng, rng.randint(*suffix_len)),
                rng.randint(*output_len)) for i in range(n)]


def multi_turn(n: int, conversations: int, system_len: int, user_len: tuple[int, int],
               output_len: tuple[int, int], tokens: Tokens, seed: int = 0) -> list[Req]:
    """Chats: each of ``conversations`` starts with its own system prompt; turn k's prompt is
    turn k-1's prompt, an assistant reply of that turn's output length and a new user message,
    so every turn extends the previous one (what a decode worker's prefix cache keeps). Turns
    interleave across conversations: request i is turn ``i // conversations`` of conversation
    ``i % conversations``."""
    rng = random.Random(f"{seed}/{tokens.salt}")
    history = [tokens.random(rng, system_len) for _ in range(conversations)]
    out = []
    for i in range(n):
        c = i % conversations
        history[c] = history[c] + tokens.random(rng, rng.randint(*user_len))
        nout = rng.randint(*output_len)
        out.append(Req(list(history[c]), nout))
        history[c] += tokens.random(rng, nout)  # stands in for the reply
    return out


def azure(path: str | Path, n: int, tokens: Tokens, scale: float = 1.0,
          max_input: int = 2048, max_output: int = 512, start: int = 0) -> list[Req]:
    """The Azure LLM trace (CSV: TIMESTAMP, ContextTokens, GeneratedTokens): its lengths times
    ``scale`` (capped), its arrival times; rows ``start`` .. ``start + n``."""
    import datetime as dt

    rng = random.Random(f"azure/{tokens.salt}")
    out, t0 = [], None
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if len(out) >= n:
                break
            ts = dt.datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            t0 = ts if t0 is None else t0
            nin = max(1, min(max_input, round(int(row["ContextTokens"]) * scale)))
            nout = max(1, min(max_output, round(int(row["GeneratedTokens"]) * scale)))
            out.append(Req(tokens.random(rng, nin), nout, ts - t0))
    return out


def mooncake(path: str | Path, n: int, tokens: Tokens, block_tokens: int = 16,
             max_input: int = 2048, max_output: int = 512) -> list[Req]:
    """The Mooncake trace (JSONL: timestamp ms, input_length, output_length, hash_ids): each
    512-token block id becomes ``block_tokens`` fixed tokens (same id, same tokens: shared
    prefixes stay shared) and lengths shrink by ``block_tokens / 512``."""
    blocks: dict[int, list[int]] = {}
    out = []
    with open(path) as f:
        for line in f:
            if len(out) >= n:
                break
            r = json.loads(line)
            ids: list[int] = []
            for h in r["hash_ids"]:
                if h not in blocks:
                    blocks[h] = tokens.random(random.Random(f"{h}/{tokens.salt}"), block_tokens)
                ids += blocks[h]
            nin = max(2, min(max_input, round(r["input_length"] * block_tokens / 512)))
            nout = max(1, min(max_output, r["output_length"]))
            out.append(Req(ids[:nin], nout, r["timestamp"] / 1000.0))
    return out


def baton_trace(path: str | Path, n: int, tokens: Tokens, max_input: int = 2048,
                max_output: int = 512, start: int = 0) -> list[Req]:
    """The live workload a router exported (``/v1/baton/workload``, JSON lines: arrival,
    prompt and output token counts, the prompt's block numbers), in arrival order from record
    ``start``: each block number becomes its ``block_tokens`` fixed tokens (same number, same
    tokens: prompts that shared a prefix share it again), the rest of the prompt pseudo-random;
    arrival offsets from the first request."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    rows.sort(key=lambda r: r["at"])
    rng = random.Random(f"baton/{tokens.salt}")
    blocks: dict[int, list[int]] = {}
    out: list[Req] = []
    for r in rows[start:start + n]:
        bt = int(r.get("block_tokens") or 16)
        ids: list[int] = []
        for b in r.get("blocks") or ():
            if b not in blocks:
                blocks[b] = tokens.random(random.Random(f"{b}/{tokens.salt}"), bt)
            ids += blocks[b]
        nin = max(1, min(max_input, int(r["prompt_tokens"])))
        ids = (ids + tokens.random(rng, max(0, nin - len(ids))))[:nin]
        nout = max(1, min(max_output, int(r["output_tokens"])))
        out.append(Req(ids, nout, r["at"] - rows[start]["at"], tuple(r.get("sampling") or ())))
    return out


def poisson(reqs: Sequence[Req], rate: float, seed: int = 0) -> list[Req]:
    """The same requests arriving as a Poisson process of ``rate`` per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for r in reqs:
        out.append(Req(r.prompt, r.max_tokens, t, r.sampling))
        t += rng.expovariate(rate)
    return out


def sampling_arg(text: str) -> tuple[str, ...]:
    """``--sampling``'s argparse type: comma-separated sampler filters every request of the
    workload asks for, by the names `baton profile` times (``temperature``, ``top_k``,
    ``min_p``, ``top_p``; the settings ``baton.control.profile.SAMPLING`` gives them);
    ``greedy`` or nothing: none. Any filter samples, so temperature is always one of them."""
    from baton.control.profile import SAMPLING

    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "greedy"]
    unknown = sorted(set(names) - set(SAMPLING))
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not a sampler filter (one of "
                                         f"greedy, {', '.join(SAMPLING)})")
    return tuple(n for n in SAMPLING if n in names or (names and n == "temperature"))


def sampling_params(filters: Sequence[str]) -> dict:
    """The sampling settings of a request that asks for ``filters`` (:func:`sampling_arg`),
    as ``baton.control.profile.SAMPLING`` gives each: ``{"temperature": 0.0}`` for none."""
    from baton.control.profile import SAMPLING

    out: dict = {"temperature": 0.0}
    for name in filters:
        out.update(SAMPLING[name])
    return out


def with_sampling(reqs: Sequence[Req], filters: Sequence[str]) -> list[Req]:
    """``reqs``, every one asking for the sampler's ``filters``."""
    return [Req(r.prompt, r.max_tokens, r.at, tuple(filters)) for r in reqs]


def draws_arg(text: str) -> int:
    """``--draws``' argparse type (`baton bench`, `baton tune`, the validation): Poisson draws
    per rate, at least one."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be >= 1")
    return n


def speed_up(reqs: Sequence[Req], factor: float) -> list[Req]:
    """A trace's own arrival times, ``factor`` times faster."""
    return [Req(r.prompt, r.max_tokens, r.at / factor, r.sampling) for r in reqs]


# ---- targets -------------------------------------------------------------------------------------


@dataclass
class Record:
    prompt_tokens: int
    max_tokens: int
    sent: float  # time.monotonic() seconds
    first: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each piece of output
    output_tokens: int = 0
    error: str | None = None  # the status / exception name; None: succeeded
    # Baton's gRPC API only: the router's path and its account of the first token's time
    path: str | None = None
    stages: dict[str, float] | None = None
    cached_tokens: int | None = None  # prompt tokens the worker reused (its pool or tiers)
    # open loop: seconds from the request's arrival time to its send (a client free to send
    # it); ``sent`` is then the arrival, so its TTFT and end-to-end time count that wait
    late: float = 0.0
    detail: str | None = None  # the error's message (Baton's gRPC API: the router's; at most
    # 300 characters), so a run's failures say why, not only which status

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        """(last token - first token) / (tokens - 1); None with fewer than 2 tokens."""
        if self.first is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def request_row(r: Record) -> dict:
    """One request's account, JSON-able: its lengths, its times (seconds, None where it has
    none) and, through Baton, its path and the stages of its first token. A measured request
    and a simulated one give the same keys, so the two can be set side by side."""
    return {"prompt": r.prompt_tokens, "max_tokens": r.max_tokens,
            "output": r.output_tokens, "error": r.error, "ttft": r.ttft, "tpot": r.tpot,
            "late": r.late, "path": r.path, "cached": r.cached_tokens,
            "stages": r.stages}


def meets(r: Record, ttft_slo: float, tpot_slo: float) -> bool:
    """Succeeded, first token within ``ttft_slo``, and (with 2+ tokens) TPOT within
    ``tpot_slo``."""
    if r.error is not None or r.ttft is None or r.ttft > ttft_slo:
        return False
    return r.tpot is None or r.tpot <= tpot_slo


def _met(attainment: float, target: float) -> bool:
    # a mean over draws of exact shares can land a rounding below it: (0.86 + 0.94) / 2 is
    # 0.8999999999999999, and a rate that met the SLOs for exactly 90% would count as a miss
    return attainment >= target - 1e-9


def lowest_failing(points: list[tuple[float, float]], target: float = 0.9) -> float | None:
    """The lowest rate :func:`find_goodput` tried that missed ``target``: the goodput it found
    is under it (None: every rate tried met it)."""
    return min((rate for rate, a in points if not _met(a, target)), default=None)


def narrow(attainment_at: Callable[[float], float], lo: float, hi: float, target: float,
           steps: int) -> tuple[float, float, list[tuple[float, float]]]:
    """``steps`` more bisections of a goodput bracket (``lo`` met ``target``, ``hi`` failed):
    (lo, hi, [(rate, attainment), ...] of the rates tried)."""
    points: list[tuple[float, float]] = []
    for _ in range(steps):
        mid = (lo + hi) / 2
        a = attainment_at(mid)
        points.append((mid, a))
        if _met(a, target):
            lo = mid
        else:
            hi = mid
    return lo, hi, points


def find_goodput(attainment_at: Callable[[float], float], start: float, target: float = 0.9,
                 max_rate: float = 1e6, refine: int = 3,
                 min_rate: float | None = None) -> tuple[float, list[tuple[float, float]]]:
    """The highest request rate whose attainment is >= ``target``: double from ``start`` until
    a rate fails (or halve until one passes), then bisect ``refine`` times between the last
    passing and first failing rates. Returns (goodput, [(rate, attainment), ...] as measured);
    goodput 0 when even ``min_rate`` (default ``start / 64``) fails."""
    min_rate = start / 64 if min_rate is None else min_rate
    points: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        a = attainment_at(rate)
        points.append((rate, a))
        return _met(a, target)

    rate = start
    if ok(rate):
        lo, hi = rate, None
        while hi is None and rate * 2 <= max_rate:
            rate *= 2
            if ok(rate):
                lo = rate
            else:
                hi = rate
        if hi is None:
            return lo, points
    else:
        hi, lo = rate, None
        while rate / 2 >= min_rate * (1 - 1e-9):
            rate /= 2
            if ok(rate):
                lo = rate
                break
            hi = rate
        if lo is None:
            return 0.0, points
    lo, _, tried = narrow(attainment_at, lo, hi, target, refine)
    return lo, points + tried
