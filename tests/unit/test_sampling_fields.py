"""The sampling fields agents send (presence, frequency and repetition penalties, logit_bias,
min_p, min_tokens, stop_token_ids), each against a reference on logits: transformers' own logits
processors where it has one (repetition penalty, min-p), OpenAI's documented formula written out
token by token where it has none; and end to end, the engine's greedy tokens equal to a greedy
loop over transformers' logits with the same processing, on a prompt whose last tokens were
generated before (a migrated request's ``output_prefix``)."""

from __future__ import annotations

import pytest
import torch
from baton.engine.errors import InvalidRequestError
from baton.engine.params import SamplingParams
from baton.engine.sampler import History, process, sample

from tests.support.sampling import reference_greedy

VOCAB = 50


def logits(seed=0):
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_is_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    row, h = logits(), History((1, 2, 2, 40), (5, 1, 9))
    got = process(row, SamplingParams(repetition_penalty=1.7), h)
    ids = torch.tensor([[*h.prompt, *h.output]])
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, row[None].clone())[0]
    assert torch.allclose(got, want)


def test_presence_and_frequency_penalties_follow_openais_formula():
    row, h = logits(1), History((3, 3, 4), (7, 7, 7, 8, 3))
    got = process(row, SamplingParams(presence_penalty=0.6, frequency_penalty=-0.4), h)
    want = row.clone()
    for tok in range(VOCAB):  # mu[j] - c[j] * a_freq - (c[j] > 0) * a_presence, output only
        c = h.output.count(tok)
        want[tok] = row[tok] - c * -0.4 - (c > 0) * 0.6
    assert torch.allclose(got, want)


def test_logit_bias_and_min_tokens():
    row = logits(2)
    p = SamplingParams(logit_bias={4: 100.0, 11: -2.5}, min_tokens=3)
    got = process(row, p, History((1,), (6, 6), stops=(0, 13)))
    assert got[0] == got[13] == float("-inf")  # two output tokens, three required
    assert got[4] == row[4] + 100 and torch.isclose(got[11], row[11] - 2.5)
    assert int(got.argmax()) == 4
    after = process(row, p, History((1,), (6, 6, 6), stops=(0, 13)))
    assert after[0] == row[0] and after[13] == row[13]


def test_min_p_keeps_what_transformers_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper

    row = logits(3)
    p = SamplingParams(temperature=0.7, min_p=0.08)
    scaled = row / 0.7
    kept_hf = torch.isfinite(MinPLogitsWarper(0.08)(None, scaled[None].clone())[0])
    counts = torch.zeros(VOCAB)
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        tok, _ = sample(row[None], [p], [gen])
        counts[tok[0]] += 1
    assert (counts > 0).sum() > 1  # it samples
    assert not (counts[~kept_hf] > 0).any()  # never a token transformers drops


@pytest.mark.parametrize("vocab", [50, 4093, 151936])
def test_top_p_keeps_what_transformers_keeps(vocab):
    """top-p ranks only the likeliest tokens (a full sort of a large vocabulary cost 4 ms a
    row): the tokens it keeps are transformers' TopPLogitsWarper's, on flat and peaked rows of
    small and large vocabularies, wherever the two rules meet (rows with a token within 1e-5 of
    the cut are skipped: there the rounding of either decides)."""
    from baton.engine.sampler import _top_p
    from transformers.generation.logits_process import TopPLogitsWarper

    gen, compared = torch.Generator().manual_seed(vocab), 0
    for scale in (0.5, 2.0, 4.0, 12.0):
        for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
            row = torch.randn(vocab, generator=gen) * scale
            probs = row.double().softmax(-1).sort(descending=True).values
            above = probs.cumsum(-1) - probs
            if ((above - top_p).abs() < 1e-5).any():
                continue
            kept_hf = torch.isfinite(TopPLogitsWarper(top_p)(None, row[None].clone())[0])
            kept = torch.isfinite(_top_p(row, top_p))
            assert torch.equal(kept, kept_hf), (scale, top_p, int(kept.sum()),
                                                int(kept_hf.sum()))
            assert torch.equal(_top_p(row, top_p)[kept], row[kept])  # the kept keep their logit
            compared += 1
    assert compared >= 8  # of 20 (a flat row of 151,936 tokens has many near any cut)


def test_logprobs_stay_the_raw_scores():
    row = logits(4)
    p = SamplingParams(logprobs=1, logit_bias={7: 50.0})
    tokens, lps = sample(row[None], [p], [torch.Generator()], [History((), ())])
    assert tokens == [7]
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(row, -1)[7]), abs=1e-5)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.1), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("min_p", 1.2), ("min_tokens", -1), ("logit_bias", {3: 200.0}), ("output_prefix", -2)])
def test_out_of_range_values_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


@pytest.mark.parametrize("prefix", [0, 6])
def test_engine_greedy_tokens_equal_the_reference_loop(tiny_llama, tiny_engine, prefix):
    _, hf = tiny_llama
    prompt = [(5 * i + 7) % 300 + 3 for i in range(20)] + [11, 11, 12, 11, 12, 13]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.3,
                            logit_bias={17: 1.5}, output_prefix=prefix)
    engine = tiny_engine()
    req = engine.add_request(prompt_token_ids=prompt, params=params)
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == req.request_id:
                out += o.new_token_ids
    assert out == reference_greedy(hf, prompt, 12, params, prefix)
    assert out != reference_greedy(hf, prompt, 12, SamplingParams(), 0)  # the processing mattered


def test_a_seeded_request_resumed_elsewhere_draws_the_same_tokens(tiny_engine):
    prompt = [(3 * i + 2) % 300 + 3 for i in range(24)]
    params = dict(max_tokens=14, temperature=1.3, seed=77, ignore_eos=True, top_k=40)

    def run(ids, **extra):
        engine = tiny_engine()
        req = engine.add_request(prompt_token_ids=ids, params=SamplingParams(**{**params,
                                                                                **extra}))
        out: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == req.request_id:
                    out += o.new_token_ids
        return out

    whole = run(prompt)
    assert len(set(whole)) > 3  # sampled, not a fixed point
    # as the router resumes a migrated request: the prompt plus the 5 tokens sent, 9 to go
    assert run(prompt + whole[:5], max_tokens=9, output_prefix=5) == whole[5:]
    assert run(prompt, seed=78) != whole


def test_a_sampled_token_follows_the_distribution_and_never_a_cut_one(monkeypatch):
    """The draw inverts the CDF at one uniform number per token: its frequencies are the
    probabilities, a token of probability 0 (masked, or cut by top-k/top-p/min-p) is never
    drawn, whatever the vocabulary's size, and a seeded generator draws the same again."""
    from baton.engine.sampler import draw, make_generator

    probs = torch.zeros(49152)
    probs[[7, 300, 49151]] = torch.tensor([0.5, 0.2, 0.3])
    gen = make_generator(1)
    n = 40_000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]), minlength=49152)
    assert set(counts.nonzero().flatten().tolist()) == {7, 300, 49151}
    for tok, p in ((7, 0.5), (300, 0.2), (49151, 0.3)):
        assert abs(counts[tok].item() / n - p) < 0.01, (tok, counts[tok].item())  # 4 sigma
    # a flat row over a whole vocabulary: every tenth of it drawn its tenth of the time
    flat = torch.full((50_000,), 1 / 50_000)
    tenths = torch.bincount(torch.tensor([draw(flat, gen) // 5000 for _ in range(n)]),
                            minlength=10)
    assert ((tenths.float() / n - 0.1).abs() < 0.01).all(), tenths.tolist()
    # a seeded generator draws the same again; a uniform number that rounds up to the total
    # still draws a token that has a probability (the last one), not one past the row
    edge = torch.tensor([0.25, 0.75, 0.0, 0.0])
    assert len({draw(edge, make_generator(11)) for _ in range(3)}) == 1
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1))
    assert draw(edge, gen) == 1
    with pytest.raises(RuntimeError, match="no token has a probability"):
        draw(torch.zeros(8), gen)


def test_sampling_rows_through_sample_keep_the_cut_tokens_out():
    """top-k through :func:`sample`: only the k most likely tokens are ever drawn."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.5, top_k=5, max_tokens=1)] * 3
    allowed = [set(torch.topk(row, 5).indices.tolist()) for row in logits]
    from baton.engine.sampler import make_generator

    gens = [make_generator(i) for i in range(3)]
    for _ in range(300):
        tokens, _ = sample(logits, params, gens)
        assert all(t in a for t, a in zip(tokens, allowed))


def test_a_row_draws_the_same_token_alone_as_beside_others():
    """A seeded row's token does not depend on which other rows (greedy or sampled, other
    temperatures and cuts) share its step, or a request would draw differently as the batch
    around it changes. (Each row is cut and drawn on its own: the same work on all rows at
    once, 22 rows of 49,152 logits, ran 2.2x slower on one core, out of its cache.)"""
    from baton.engine.sampler import make_generator

    rows = torch.randn(6, 3001, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=1),
              SamplingParams(temperature=1.3, top_k=40, max_tokens=1),
              SamplingParams(temperature=1.0, min_p=0.05, max_tokens=1),
              SamplingParams(temperature=1.0, max_tokens=1),
              SamplingParams(temperature=0.6, top_p=0.5, top_k=100, min_p=0.01, max_tokens=1)]
    for step in range(20):
        together, _ = sample(rows, params, [make_generator(100 * step + i) for i in range(6)])
        alone = [sample(rows[i:i + 1], [p], [make_generator(100 * step + i)])[0][0]
                 for i, p in enumerate(params)]
        assert together == alone, step
