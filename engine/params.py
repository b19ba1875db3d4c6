"""Sampling parameters, validated once at submission (never in the hot path)."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible per request: the same seed, prompt and parameters give the
    same tokens; each draw comes from a generator seeded with (seed, its output position), so a
    hand-off or a migration to another worker continues the same sequence. ``logprobs = n``
    returns the sampled token's log-probability and the top ``n``.
    Stop strings are removed from the returned text, like vLLM and the OpenAI API do.

    Logit processing, in order (as vLLM applies it; ``engine/sampler.py``), greedy rows too:
    before ``min_tokens`` output tokens, EOS and ``stop_token_ids`` are masked (and no stop
    condition ends the request); ``logit_bias`` (token id -> added to its logit);
    ``repetition_penalty`` on every token of the prompt and the output (a positive logit divided
    by it, a negative one multiplied); ``frequency_penalty`` times each token's count in the
    output and ``presence_penalty`` once per token present in it, subtracted. Then temperature,
    ``min_p`` (drop tokens whose probability is under ``min_p`` times the most likely one's),
    top-k, top-p. ``output_prefix``: the last that many prompt tokens were generated before (a
    request migrated to another worker after streaming them): they count as output for the
    penalties and ``min_tokens``, so the state is rebuilt from the tokens alone.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    output_prefix: int = 0
    # structured output: an llguidance grammar (engine/grammar.py) the tokens must follow; ""
    # for none. The sampler masks every token it forbids, on both roles
    grammar: str = ""
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
        self._check_processing()

    def _check_processing(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(name, getattr(self, name), "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidRequestError("repetition_penalty", self.repetition_penalty,
                                      "must be in (0, 100]; 1 is off")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", self.min_p, "must be in [0, 1]")
        for name in ("min_tokens", "output_prefix"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise InvalidRequestError(name, getattr(self, name), "must be an integer >= 0")
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or tok < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError("logit_bias", {tok: bias},
                                          "token ids >= 0, biases in [-100, 100]")

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before sampling (beyond temperature and the
        top-k/top-p/min-p filters)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
