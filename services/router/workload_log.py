"""The live workload, as the router saw it: one record per finished request, kept for a rolling
window, exported as a trace ``baton tune`` reads (``--format baton``).

A record holds lengths, counts and times only: arrival time, prompt and output token counts,
cached tokens (what the workers reused, what the index predicted), the path and finish reason,
the time to first token split into its phases (metrics.TTFT_PHASES), TPOT. No prompt text and
no token ids leave the router: the prompt's prefix structure is kept as block numbers, each
prompt block's hash replaced by a small integer in first-seen order (two prompts that share
their first k blocks share their first k numbers, and nothing else can be read from them).

Memory is bounded: at most ``max_records`` records (the oldest go first) and those within
``window_s``; the hash-to-number map forgets its least recently used entries past
``max_blocks``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

from baton.services.common.metrics import ttft_phases

HASH_BYTES = 32  # one SHA-256 digest per prompt block (engine/block_hash.py)


class WorkloadLog:
    def __init__(self, window_s: float = 900.0, max_records: int = 50_000,
                 max_blocks: int = 200_000, clock=time.time) -> None:
        self.window_s, self.max_records, self.max_blocks = window_s, max_records, max_blocks
        self.clock = clock
        self._records: deque[dict] = deque(maxlen=max_records)
        self._numbers: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()

    def record(self, final, arrived: float, hashes: bytes | None, block_size: int) -> None:
        """One finished request: its final message, its arrival (unix seconds) and its prompt's
        block hashes (None when routing did not hash it)."""
        t, u = final.timing, final.usage
        out = u.completion_tokens
        rec = {"at": round(arrived, 4), "prompt_tokens": u.prompt_tokens, "output_tokens": out,
               "cached_tokens": u.cached_tokens, "index_cached_tokens": final.index_cached_tokens,
               "path": final.path, "finish_reason": final.finish_reason,
               "ttft_s": round(t.first_token_s, 5),
               "tpot_s": round(t.decode_s / (out - 1), 6) if out > 1 else None,
               "phases": {k: round(v, 5) for k, v in ttft_phases(t).items()},
               "block_tokens": block_size}
        with self._lock:
            rec["blocks"] = self._number(hashes)
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

    def export(self) -> list[dict]:
        """The window's records, oldest first."""
        with self._lock:
            self._expire()
            return list(self._records)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
