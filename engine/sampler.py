"""Token sampling: logit processing (penalties, bias, min_tokens), greedy, temperature, min-p,
top-k, top-p, per-request seeds, top-n logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from baton.engine.params import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token and the ``n`` most likely ones (raw model scores)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at output ``position``: a function of the
    two alone, so a decode worker after a hand-off, or another after a migration, draws what the
    first would have."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


@dataclass(frozen=True)
class History:
    """What a request's logit processing reads: its prompt and output tokens so far (a
    migrated request's ``output_prefix`` moved from the prompt to the output), and the token ids
    ``min_tokens`` holds back (EOS and ``stop_token_ids``)."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    stops: tuple[int, ...] = ()


def process(row: torch.Tensor, p: SamplingParams, h: History) -> torch.Tensor:
    """One row of logits after ``min_tokens``, ``logit_bias`` and the three penalties (see
    :class:`SamplingParams`): a new float32 tensor."""
    row = row.float().clone()
    if len(h.output) < p.min_tokens and h.stops:
        row[torch.tensor(h.stops)] = float("-inf")
    for tok, bias in p.logit_bias:
        if tok < row.shape[0]:
            row[tok] += bias
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(h.prompt) | set(h.output)), dtype=torch.long)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                    vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and h.output:
        counts = torch.bincount(torch.tensor(h.output), minlength=row.shape[0])[:row.shape[0]]
        row -= p.frequency_penalty * counts.float() + p.presence_penalty * (counts > 0).float()
    return row


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
    histories: list[History] | None = None, masks: list[torch.Tensor | None] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [N, vocab] float32, one row per request. Returns the tokens and optional logprobs
    (of the raw scores). ``histories`` (one per row) feed the rows whose parameters process
    their logits; ``masks`` (a bool row or None each): the tokens a row's grammar allows, the
    others never sampled."""
    raw = logits
    if histories is not None and any(p.processes_logits for p in params):
        logits = torch.stack([process(logits[i], p, histories[i]) if p.processes_logits
                              else logits[i].float() for i, p in enumerate(params)])
    if masks is not None:
        logits = torch.stack([row if m is None else row.float().masked_fill(~m, float("-inf"))
                              for row, m in zip(logits, masks)])
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done; others are replaced below
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.logprobs is not None:
            lp = torch.log_softmax(raw[i].float(), dim=-1)
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
    if p.min_p > 0.0:  # under min_p times the top token's probability: max(row) is 0 here
        row = row.masked_fill(row < math.log(p.min_p), float("-inf"))
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        row = _top_p(row, p.top_p)
    return draw(row.exp(), gen)  # the softmax's numerators: the largest is 1 (row's max is 0)


# top-p's buckets: a row's tokens by how far below its likeliest they are, 1/8 nat a bucket,
# the last holding everything 64 nats or more below (a probability under 1.6e-28 of the top's)
TOP_P_BUCKETS, BUCKETS_PER_NAT = 512, 8


def _top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """``row`` with every token dropped (-inf) whose likelier tokens already cover ``top_p``
    of the probability (so at least one is kept), without sorting the row (a sort of a
    49,152-token row took 3.6 ms on one core, 80 ms of a decode step of 22 streams). Tokens
    fall into buckets by logit (a likelier token never in a later bucket); the buckets'
    masses find the one the cut falls in, every token of the buckets before it is kept (they
    cover at most ``top_p``), every one after it dropped, and that bucket alone is sorted to
    place the cut. Tokens tied at the cut's probability are all kept."""
    probs = row.softmax(dim=-1)
    # (a non-negative float to int32 is its floor; int64 took 4x as long)
    bucket = ((row.max() - row) * BUCKETS_PER_NAT).clamp_(0, TOP_P_BUCKETS - 1).int()
    mass = torch.bincount(bucket, weights=probs.double(), minlength=TOP_P_BUCKETS).cumsum(0)
    cut = min(int(torch.searchsorted(mass, mass.new_tensor([top_p]), right=True)),
              TOP_P_BUCKETS - 1)  # the first bucket whose tokens and the likelier pass top_p
    before = float(mass[cut - 1]) if cut else 0.0
    inside = torch.sort(probs[bucket == cut], descending=True).values.double()
    above = before + inside.cumsum(0) - inside  # each token's likelier tokens' probability
    lowest = float(inside[int((above <= top_p).sum()) - 1])  # the first is kept: above <= top_p
    return row.masked_fill(probs < lowest, float("-inf"))


def draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """One token with probability proportional to ``weights`` (a row of non-negative numbers:
    probabilities, or a softmax's numerators), by inverting its CDF at one uniform number from
    ``gen``: the distribution ``torch.multinomial`` samples, for one random number instead of
    one for each vocabulary entry (multinomial draws an exponential for every entry: 1.1-1.3 ms
    a row of a 49,152-token vocabulary on one core, 29 ms of a decode step of 22 sampled
    streams). A token of weight 0 (masked, or cut by top-k, top-p or min-p) is never drawn:
    its CDF step is empty. (On a CPU the cumulative sum adds in float64 and rounds each
    partial sum to float32, so a step is its weight to 1e-7 of the total.)"""
    cdf = weights.float().cumsum(dim=-1)
    total = float(cdf[-1])
    if not total > 0.0:  # NaN or all zero: nothing to draw from (the caller's bug)
        raise RuntimeError(f"no token has a probability (the weights sum to {total})")
    x = torch.rand(1, generator=gen) * total
    i = int(torch.searchsorted(cdf, x, right=True))  # the first token whose CDF exceeds x
    if i >= cdf.shape[-1]:  # x rounded up to the total: the last token with a weight
        i = int(weights.nonzero()[-1])
    return i
