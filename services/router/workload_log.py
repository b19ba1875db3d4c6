"""The live workload, as the router saw it: one record per request that arrived within a rolling
window, exported as a trace ``baton tune`` reads (``--format baton``). A request still running is
in it too (``"in_flight": true``): under overload most of the window's arrivals have not
finished, and a log of finished requests alone would show the tuner an idle cluster. Its output
length is not known yet: the window's finished requests' mean, at most its ``max_tokens`` (all
of its ``max_tokens`` while none has finished).

A record holds lengths, counts and times only: arrival time, prompt and output token counts,
cached tokens (what the workers reused, what the index predicted), the path and finish reason,
the time to first token split into its phases (metrics.TTFT_PHASES), TPOT, and the names of the
sampler's filters it asked for (:func:`sampling_filters`: a sampled token costs a step more than
a greedy one, by filter). No prompt text and
no token ids leave the router: the prompt's prefix structure is kept as block numbers, each
prompt block's hash replaced by a small integer in first-seen order (two prompts that share
their first k blocks share their first k numbers, and nothing else can be read from them).

Memory is bounded: at most ``max_records`` finished records (the oldest go first) and as many
running ones, those that arrived within ``window_s``; the hash-to-number map forgets its least
recently used entries past ``max_blocks``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

from baton.services.common.metrics import ttft_phases

HASH_BYTES = 32  # one SHA-256 digest per prompt block (engine/block_hash.py)


def sampling_filters(params) -> list[str]:
    """The sampler's filters a request's ``params`` (a ``baton.v1.SamplingParams``) put to
    work on each token's row, by the names `baton profile` times them under
    (``baton.control.profile.SAMPLING``): none for greedy (temperature 0: an argmax, whatever
    else it sets), else temperature and each of top-k, min-p, top-p it sets."""
    if params.temperature == 0.0:
        return []
    out = ["temperature"]
    if params.top_k > 0:
        out.append("top_k")
    if params.min_p > 0.0:
        out.append("min_p")
    if params.HasField("top_p") and params.top_p < 1.0:
        out.append("top_p")
    return out


class WorkloadLog:
    def __init__(self, window_s: float = 900.0, max_records: int = 50_000,
                 max_blocks: int = 200_000, clock=time.time) -> None:
        self.window_s, self.max_records, self.max_blocks = window_s, max_records, max_blocks
        self.clock = clock
        self._records: deque[dict] = deque(maxlen=max_records)  # in the order they finished
        self._open: OrderedDict[str, dict] = OrderedDict()  # running, by the router's id
        self._numbers: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()

    def arrive(self, rid: str, arrived: float, prompt_tokens: int, max_tokens: int,
               hashes: bytes | None, block_size: int, sampling: list[str] | None = None
               ) -> None:
        """A request the router admitted (``rid``: the router's id for it; ``arrived``: unix
        seconds; ``sampling``: its :func:`sampling_filters`); it stays in flight until
        :meth:`record` or :meth:`forget`."""
        rec: dict = {"at": round(arrived, 4), "prompt_tokens": prompt_tokens,
                     "max_tokens": max_tokens, "block_tokens": block_size,
                     "sampling": list(sampling or ())}
        with self._lock:
            rec["blocks"] = self._number(hashes)
            self._open[rid] = rec
            if len(self._open) > self.max_records:
                self._open.popitem(last=False)

    def forget(self, rid: str) -> None:
        """A request that ended without finishing (failed, cancelled): no record."""
        with self._lock:
            self._open.pop(rid, None)

    def record(self, final, arrived: float, hashes: bytes | None = None, block_size: int = 16,
               rid: str | None = None) -> None:
        """One finished request: its final message and its arrival (unix seconds); ``rid`` ends
        its :meth:`arrive`, whose block numbers it keeps; without one, its prompt's block hashes
        (None when routing did not hash it) and their block size."""
        t, u = final.timing, final.usage
        out = u.completion_tokens
        rec = {"at": round(arrived, 4), "prompt_tokens": u.prompt_tokens, "output_tokens": out,
               "cached_tokens": u.cached_tokens, "index_cached_tokens": final.index_cached_tokens,
               "path": final.path, "finish_reason": final.finish_reason,
               "ttft_s": round(t.first_token_s, 5),
               "tpot_s": round(t.decode_s / (out - 1), 6) if out > 1 else None,
               "phases": {k: round(v, 5) for k, v in ttft_phases(t).items()}}
        with self._lock:
            opened = self._open.pop(rid, None) if rid is not None else None
            if rec["at"] < self.clock() - self.window_s:
                return  # it arrived before the window: not part of it
            rec["block_tokens"] = opened["block_tokens"] if opened else block_size
            rec["blocks"] = opened["blocks"] if opened else self._number(hashes)
            rec["sampling"] = opened["sampling"] if opened else []
            self._records.append(rec)
            self._expire()

    def _number(self, hashes: bytes | None) -> list[int]:
        if not hashes:
            return []
        out = []
        for i in range(0, len(hashes), HASH_BYTES):
            h = hashes[i:i + HASH_BYTES]
            n = self._numbers.get(h)
            if n is None:
                n, self._next = self._next, self._next + 1
                self._numbers[h] = n
                if len(self._numbers) > self.max_blocks:
                    self._numbers.popitem(last=False)
            else:
                self._numbers.move_to_end(h)
            out.append(n)
        return out

    def _expire(self) -> None:
        oldest = self.clock() - self.window_s
        while self._records and self._records[0]["at"] < oldest:
            self._records.popleft()
        while self._open and next(iter(self._open.values()))["at"] < oldest:
            self._open.popitem(last=False)

    def export(self) -> list[dict]:
        """The window's records by arrival, oldest first: finished ones, then (at their
        arrival) those in flight with their output length estimated."""
        with self._lock:
            self._expire()
            oldest = self.clock() - self.window_s
            done = [r for r in self._records if r["at"] >= oldest]  # finish order != arrival
            running = list(self._open.values())
        mean = sum(r["output_tokens"] for r in done) / len(done) if done else None
        rows = done + [{**r, "in_flight": True, "output_tokens": max(1, round(min(
            r["max_tokens"], mean if mean is not None else r["max_tokens"])))} for r in running]
        return sorted(rows, key=lambda r: r["at"])

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
