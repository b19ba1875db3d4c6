"""Sampling parameters, validated once at submission (never in the hot path)."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible per request: the same seed, prompt and parameters give the
    same tokens. ``logprobs = n`` returns the sampled token's log-probability and the top ``n``.
    Stop strings are removed from the returned text, like vLLM and the OpenAI API do.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None
    # max_tokens is an upper bound the engine lowers to what its KV pool holds beside the
    # prompt (a chat completion without max_tokens: to EOS, the context or the pool)
    fit_pool: bool = False
    detokenize: bool = True
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError("temperature", self.temperature, "must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", self.top_k, "must be an integer >= 0 (0 = off)")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise InvalidRequestError("logprobs", self.logprobs, "must be in [0, 20]")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", self.stop, "stop strings must be non-empty")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError("seed", self.seed, "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
