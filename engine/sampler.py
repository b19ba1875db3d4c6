"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, top-n logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from baton.engine.params import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token and the ``n`` most likely ones (raw model scores)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [N, vocab] float32, one row per request. Returns the tokens and optional logprobs."""
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done; others are replaced below
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.logprobs is not None:
            lp = torch.log_softmax(logits[i], dim=-1)
            top = torch.topk(lp, p.logprobs) if p.logprobs else None
            pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top else ()
            logprobs[i] = TokenLogprobs(tokens[i], float(lp[tokens[i]]), pairs)
    return tokens, logprobs


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    # shifted so the largest logit is 0 before dividing, and the temperature kept a float32
    # normal: a tiny temperature (1e-38, or 1e-300, which is 0 in float32) then sends the
    # others to -inf instead of overflowing them all to inf or dividing 0 by 0, whose softmax
    # is NaN (that killed the engine loop); the distribution is the same
    row = (row - row.max()) / max(p.temperature, torch.finfo(torch.float32).tiny)
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already cover top_p (keeps at least one)
        drop = (probs.cumsum(dim=-1) - probs) > p.top_p
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = row.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
