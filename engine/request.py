"""A request's state: its tokens, a few counters, and an ordered status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from baton.engine.block_hash import hash_blocks
from baton.engine.params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED counts as finished.

    The two hand-off states are statuses too: RESERVED (decode side: blocks allocated, the
    prompt's KV still arriving from another engine; ``commit_handoff`` makes it RUNNING) and
    FINISHED_PREFILLED (prefill side: finished, its blocks pinned until ``release_handoff``).
    """

    WAITING = 0
    RESERVED = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_PREFILLED = 7  # prefill-only request: first token sampled, blocks pinned for hand-off

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_PREFILLED: "prefilled",
}


@dataclass
class Request:
    """One generation request inside the engine.

    Token layout (``all_token_ids = prompt + output``)::

        |<------------------- num_tokens ------------------->|
        |<--- num_computed_tokens --->|<--- still to run --->|
        |<- num_cached ->|   (prefix-cache hit, never recomputed)

    Prefill and decode are the same thing: ``num_computed_tokens`` catching up with ``num_tokens``.
    When they meet, the engine samples one more token.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: bytes
    block_size: int
    max_tokens: int  # params.max_tokens capped by the model's context length
    prefill_only: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the (last) admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # pool, host, disk
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # structured output: the request's llguidance matcher (engine/grammar.py), or None
    matcher: object = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prior_output(self) -> int:
        """Prompt tokens that were generated earlier (a migrated request's ``output_prefix``,
        the last tokens of its prompt): output for penalties, min_tokens, grammar and seeds."""
        return min(self.params.output_prefix, self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Extend the chained hashes to every full block of ``all_token_ids``."""
        done = len(self.block_hashes) * self.block_size
        if self.num_tokens - done >= self.block_size:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes += hash_blocks(
                self.all_token_ids[done:], self.block_size, self.namespace, parent
            )
