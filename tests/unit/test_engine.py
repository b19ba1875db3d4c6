"""Engine scenarios on a tiny random Llama: batching, chunking, preemption, abort, stop conditions,
sampling, bad input, and the prefill -> decode hand-off between two engine instances."""

from __future__ import annotations

import os
import random

import pytest
from baton.engine.errors import InvalidRequestError, RequestTooLargeError
from baton.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 400) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def one_by_one(engine, ps, params=GREEDY) -> list[list[int]]:
    return [engine.generate([p], params)[0].token_ids for p in ps]


def drain_outputs(engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def drain(engine) -> dict[str, list[int]]:
    """Step to completion; each request's generated token ids."""
    got: dict[str, list[int]] = {}
    for out in drain_outputs(engine):
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def test_continuous_batch_equals_one_at_a_time(tiny_engine):
    ps = prompts(8)
    alone = one_by_one(tiny_engine(enable_prefix_caching=False), ps)
    eng = tiny_engine()
    batched = [c.token_ids for c in eng.generate(ps, GREEDY)]
    assert batched == alone
    assert all(len(t) == 12 for t in batched)
    eng.check_integrity()
    assert eng.kv.pool.num_free_blocks == eng.num_blocks  # everything back in the free queue


def test_chunked_prefill_equals_whole_prefill(tiny_engine):
    ps = prompts(4, seed=1, lo=30, hi=60)
    whole = [c.token_ids for c in tiny_engine(max_num_batched_tokens=512).generate(ps, GREEDY)]
    eng = tiny_engine(max_num_batched_tokens=7)  # every prompt runs in several chunks
    first = eng.add_request(params=GREEDY, prompt_token_ids=ps[0])
    eng.step()
    assert 0 < first.num_computed_tokens == 7 < len(ps[0])
    eng.abort(first.request_id)
    drain(eng)
    assert [c.token_ids for c in eng.generate(ps, GREEDY)] == whole
    eng.check_integrity()


def test_the_prompt_tokens_left_to_compute_follow_each_request_to_its_first_token(tiny_engine):
    """What the engine publishes for the routers' ``prefill`` scorer: every queued request's
    tokens, a running one's until its prompt is in (a decoding request counts none), and a
    request aborted while queued taken off at once."""
    eng = tiny_engine(max_num_batched_tokens=16, max_num_seqs=2)
    a = eng.add_request(params=GREEDY, prompt_token_ids=list(range(1, 41)))
    b = eng.add_request(params=GREEDY, prompt_token_ids=list(range(101, 111)))
    c = eng.add_request(params=GREEDY, prompt_token_ids=list(range(201, 231)))
    assert eng.stats().prefill_tokens == 80
    eng.step()  # 16 of a's 40
    assert eng.stats().prefill_tokens == 64
    eng.step()  # 16 more of a's
    assert eng.stats().prefill_tokens == 48
    eng.step()  # a's last 8 and b's 8 of 10 (two running: max_num_seqs); a decodes from here
    assert a.num_output_tokens == 1 and eng.stats().prefill_tokens == 2 + 30
    eng.abort(c.request_id)  # still queued
    assert eng.stats().prefill_tokens == 2
    eng.step()  # b's last 2: both decode
    assert b.num_output_tokens == 1 and eng.stats().prefill_tokens == 0
    drain(eng)
    assert eng.stats().prefill_tokens == 0


def test_integrity_check_mid_flight(tiny_engine):
    # workers run it on request (Info check_integrity) while requests run, not only when idle
    eng = tiny_engine()
    eng.add_request(params=GREEDY, prompt_token_ids=prompts(1)[0])
    eng.add_request(params=GREEDY, prompt_token_ids=prompts(1, seed=5)[0])
    eng.step()
    assert len(eng.scheduler.running) == 2
    eng.check_integrity()
    drain(eng)
    eng.check_integrity()


def test_preemption_recomputes_and_gives_same_tokens(tiny_engine):
    ps = prompts(6, seed=2, lo=20, hi=30)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = [c.token_ids for c in tiny_engine(num_kv_blocks=128).generate(ps, params)]
    # 6 requests x up to 54 tokens need ~80 blocks of 4; 30 blocks force preemptions
    eng = tiny_engine(num_kv_blocks=30)
    tight = [c.token_ids for c in eng.generate(ps, params)]
    assert eng.scheduler.stats.num_preemptions > 0
    assert tight == roomy
    # step by step, the published count of tokens to compute follows the queues through every
    # preemption (a preempted request's whole context counts again)
    eng = tiny_engine(num_kv_blocks=30)
    for p in ps:
        eng.add_request(params=params, prompt_token_ids=p)
    while eng.has_unfinished():
        eng.step()
        sched = eng.scheduler
        want = sum(max(0, r.num_tokens - r.num_computed_tokens) for r in sched.waiting)
        want += sum(r.num_tokens - r.num_computed_tokens for r in sched.running
                    if r.num_tokens - r.num_computed_tokens > 1)
        assert eng.stats().prefill_tokens == want
    assert eng.scheduler.stats.num_preemptions > 0 and eng.stats().prefill_tokens == 0
    eng.check_integrity()
    assert eng.kv.pool.num_free_blocks == 30


def test_abort_frees_blocks_at_every_stage(tiny_engine):
    eng = tiny_engine(max_num_batched_tokens=8)
    free0 = eng.kv.pool.num_free_blocks
    waiting = eng.add_request(params=GREEDY, prompt_token_ids=list(range(10, 40)))
    assert eng.abort(waiting.request_id)  # before it was scheduled
    mid = eng.add_request(params=GREEDY, prompt_token_ids=list(range(10, 40)))
    outs = eng.step()  # mid-prefill (8 of 30 tokens)
    assert 0 < mid.num_computed_tokens < 30
    assert eng.abort(mid.request_id)
    dec = eng.add_request(params=SamplingParams(max_tokens=50, ignore_eos=True),
                          prompt_token_ids=[5, 6, 7])
    for _ in range(4):
        outs += eng.step()  # decoding
    assert dec.num_output_tokens >= 2
    assert eng.abort(dec.request_id)
    assert not eng.abort(dec.request_id)  # already gone
    assert not eng.abort("never-existed")
    outs += eng.step()
    aborted = [o for o in outs if o.finished]
    assert [o.request_id for o in aborted] == [waiting.request_id, mid.request_id, dec.request_id]
    assert all(o.finish_reason == "abort" for o in aborted)
    assert not eng.has_unfinished()
    eng.check_integrity()
    assert eng.kv.pool.num_free_blocks == free0
    assert not eng.requests


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"logprobs": 99}, "logprobs"),
    ({"stop": ("",)}, "stop"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert field in str(e.value) and repr(next(iter(kwargs.values())))[:3] in str(e.value)


def test_bad_requests_are_rejected_and_engine_keeps_serving(tiny_engine):
    eng = tiny_engine(num_kv_blocks=16, max_model_len=200)
    good = eng.add_request(params=GREEDY, prompt_token_ids=[5, 6, 7, 8])
    first = eng.step()
    cases = [
        (dict(prompt=""), "prompt"),
        (dict(prompt_token_ids=[]), "prompt"),
        (dict(prompt_token_ids=[1, 2, 400]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, -3]), "prompt_token_ids"),
        (dict(messages=[]), "messages"),
        (dict(prompt_token_ids=[7] * 200), "prompt"),  # longer than the context
        (dict(prompt="a", prompt_token_ids=[1]), "prompt"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request(params=GREEDY, **kwargs)
        assert e.value.field == field, kwargs
    # fits the context but never the pool: 16 blocks x 4 tokens = 64 tokens
    with pytest.raises(RequestTooLargeError, match="16"):
        eng.add_request(params=SamplingParams(max_tokens=40), prompt_token_ids=[9] * 30)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request(params=GREEDY, prompt_token_ids=[1], request_id=good.request_id)
    got = drain(eng)
    assert list(got) == [good.request_id]
    assert len(first[0].new_token_ids + got[good.request_id]) == 12
    eng.check_integrity()
    # unless max_tokens is only an upper bound (a chat without max_tokens): lowered to the pool
    fitted = eng.add_request(params=SamplingParams(max_tokens=40, fit_pool=True,
                                                   ignore_eos=True), prompt_token_ids=[9] * 30)
    assert fitted.max_tokens == 64 - 30
    assert len(drain(eng)[fitted.request_id]) == 34
    eng.check_integrity()


def test_seed_reproducible_and_sampling_filters(tiny_engine):
    eng = tiny_engine()
    p = [[11, 12, 13, 14, 15]]
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    a = eng.generate(p, sp)[0].token_ids
    b = eng.generate(p * 3, sp)  # same seed inside a batch: same tokens for each
    assert all(c.token_ids == a for c in b)
    other = eng.generate(p, SamplingParams(max_tokens=20, temperature=1.0, seed=99,
                                           ignore_eos=True))[0].token_ids
    assert other != a
    # top_k=1 and a tiny top_p are greedy whatever the temperature
    greedy = eng.generate(p, SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        sp = SamplingParams(max_tokens=20, temperature=5.0, seed=3, ignore_eos=True, **kw)
        assert eng.generate(p, sp)[0].token_ids == greedy, kw


def test_a_vanishing_temperature_samples_the_argmax_and_the_engine_lives(tiny_engine):
    # 1e-38 overflowed every logit / temperature to inf and 1e-300 is 0 in float32: the softmax
    # was NaN, torch.multinomial raised, and the engine loop died for every request
    eng = tiny_engine()
    p = [[11, 12, 13, 14, 15]]
    greedy = eng.generate(p, SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    for t in (1e-20, 1e-38, 1e-41, 1e-300):
        for kw in ({}, {"top_p": 0.5}, {"top_k": 3}):
            sp = SamplingParams(max_tokens=6, temperature=t, seed=5, ignore_eos=True, **kw)
            assert eng.generate(p, sp)[0].token_ids == greedy, (t, kw)
    eng.check_integrity()


def test_logprobs(tiny_engine):
    eng = tiny_engine()
    c = eng.generate([[20, 21, 22]], SamplingParams(max_tokens=5, logprobs=3,
                                                     ignore_eos=True))[0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        top_ids = [t for t, _ in lp.top]
        assert top_ids[0] == tok  # greedy picks the most likely token
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True) and lp.logprob == pytest.approx(vals[0])


def test_stop_conditions(tiny_engine):
    eng = tiny_engine()
    p = [30, 31, 32, 33]
    free_run = eng.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    toks = free_run.token_ids
    # max_tokens
    assert len(toks) == 20 and free_run.finish_reason == "length"
    # a stop token id ends the request at its first occurrence (and includes it)
    stop_id = toks[5]
    c = eng.generate([p], SamplingParams(max_tokens=20, ignore_eos=True,
                                         stop_token_ids=(stop_id,)))[0]
    assert c.token_ids == toks[: toks.index(stop_id) + 1] and c.finish_reason == "stop"
    # EOS: make the model's own 4th token an EOS by declaring it one
    eng.requests.clear()
    req = eng.add_request(params=SamplingParams(max_tokens=20), prompt_token_ids=p)
    req.eos_token_ids = (toks[3],)
    got = drain(eng)[req.request_id]
    assert got == toks[: toks.index(toks[3]) + 1]
    # a stop string is cut from the text, and the text never streamed past it
    text = free_run.text
    assert len(text) > 6
    stop = text[3:6]
    stream = []
    req = eng.add_request(params=SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)),
                          prompt_token_ids=p)
    while eng.has_unfinished():
        for out in eng.step():
            stream.append(out.new_text)
            last = out
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert "".join(stream) == text[: text.index(stop)]
    eng.check_integrity()


def test_prefix_cache_reuses_blocks_and_salt_separates(tiny_engine):
    eng = tiny_engine()
    prefix = list(range(50, 90))  # 40 tokens = 10 full blocks of 4
    cold = eng.generate([prefix + [7, 8, 9]], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    warm = eng.generate([prefix + [7, 8, 9]], GREEDY)[0]
    assert warm.num_cached_tokens == 40 and warm.token_ids == cold.token_ids
    salted = eng.generate([prefix + [7, 8, 9]], SamplingParams(max_tokens=12, ignore_eos=True,
                                                               cache_salt="tenant-b"))[0]
    assert salted.num_cached_tokens == 0 and salted.token_ids == cold.token_ids


def _handoff(prefill, decode, ids, params, rid):
    prefill.add_request(params=params, prompt_token_ids=ids, request_id=rid, prefill_only=True)
    outs = drain_outputs(prefill)
    (first,) = [o for o in outs if o.request_id == rid]
    h = first.handoff
    assert first.finished and first.finish_reason == "prefilled" and h is not None
    assert h.num_tokens == len(ids) and h.first_token_id == first.new_token_ids[0]
    slots = decode.reserve_handoff(rid, h.prompt_token_ids, h.first_token_id, params)
    assert len(slots.block_ids) == len(h.block_ids)
    for src, dst in list(zip(h.block_ids, slots.block_ids))[slots.num_local_blocks:]:
        decode.kv_cache[dst].copy_(prefill.kv_cache[src])
    prefill.release_handoff(rid)
    tokens = []
    for out in decode.commit_handoff(rid):
        tokens += out.new_token_ids
    tokens += drain(decode).get(rid, [])
    return tokens, slots


def test_handoff_between_engines_gives_same_tokens(tiny_engine):
    ps = prompts(3, seed=5, lo=9, hi=30)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    single = one_by_one(tiny_engine(), ps, params)
    pre, dec = tiny_engine(), tiny_engine()
    for i, p in enumerate(ps):
        tokens, slots = _handoff(pre, dec, p, params, f"h{i}")
        assert slots.num_local_blocks == 0
        assert tokens == single[i]
    # the decode engine now caches the first prompt's blocks: a second hand-off of a prompt
    # sharing them transfers only the rest
    tokens, slots = _handoff(pre, dec, ps[0], params, "again")
    assert slots.num_local_blocks == len(ps[0]) // 4
    assert tokens == single[0]
    for e in (pre, dec):
        e.check_integrity()
        assert e.kv.pool.num_free_blocks == e.num_blocks and not e.requests


def test_seeded_sampling_continues_across_a_handoff(tiny_engine):
    ps = prompts(3, seed=7, lo=9, hi=30)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=50, seed=99)
    single = one_by_one(tiny_engine(), ps, params)
    pre, dec = tiny_engine(), tiny_engine()
    for i, p in enumerate(ps):  # no sampler state travels: draws follow (seed, position)
        assert _handoff(pre, dec, p, params, f"s{i}")[0] == single[i]
    for e in (pre, dec):
        e.check_integrity()


def test_handoffs_wait_for_a_slot_in_the_running_batch(tiny_engine):
    # a hand-off joins the running batch directly: it must respect max_num_seqs as admissions
    # from the queue do, however many blocks are free
    dec = tiny_engine(num_kv_blocks=64, max_num_seqs=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(5, 14))
    a = dec.reserve_handoff("a", prompt, 7, params)
    b = dec.reserve_handoff("b", prompt, 7, params)
    assert a is not None and b is not None
    dec.commit_handoff("a")  # one running, one reserved: the batch is full
    assert dec.reserve_handoff("c", prompt, 7, params) is None and "c" not in dec.requests
    assert dec.kv.pool.num_free_blocks > 16  # blocks were not what was missing
    dec.commit_handoff("b")
    assert len(dec.scheduler.running) == 2
    drain(dec)  # both finish: room again
    assert dec.reserve_handoff("c", prompt, 7, params) is not None
    dec.commit_handoff("c")
    drain(dec)
    dec.check_integrity()
    assert dec.kv.pool.num_free_blocks == 64 and not dec.requests


def test_handoff_reserve_then_abort_frees(tiny_engine):
    dec = tiny_engine(num_kv_blocks=10)
    params = SamplingParams(max_tokens=4)
    slots = dec.reserve_handoff("x", list(range(5, 30)), 7, params)  # 25 tokens -> 7 blocks
    assert len(slots.block_ids) == 7
    assert dec.reserve_handoff("y", list(range(5, 30)), 7, params) is None  # not now
    assert "y" not in dec.requests
    assert dec.abort("x")
    drain(dec)
    dec.check_integrity()
    assert dec.kv.pool.num_free_blocks == 10
    pre = tiny_engine()
    pre.add_request(params=params, prompt_token_ids=[5, 6, 7, 8, 9], request_id="p",
                    prefill_only=True)
    drain(pre)
    assert pre.kv.pool.num_free_blocks < pre.num_blocks  # pinned for the receiver
    assert pre.abort("p")
    drain(pre)
    pre.check_integrity()
    assert pre.kv.pool.num_free_blocks == pre.num_blocks


def _vm_flags(addr: int) -> list[str]:
    """The kernel's VmFlags of the mapping of this process holding ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="a kernel without transparent huge pages")
def test_the_kv_pool_and_weights_ask_for_huge_pages_unless_told_not_to(monkeypatch):
    """A CPU KV pool and a resident weight are advised to use transparent huge pages (the
    kernel marks the mapping ``hg``) by default; ``BATON_HUGE_PAGES=0`` (which the tests run
    under) leaves them on plain pages; any other value is refused naming the variable."""
    import torch
    from baton.engine.model import resident
    from baton.engine.runner import alloc_kv_pool

    def advised() -> list[bool]:
        pool = alloc_kv_pool((4, 2, 1 << 18), torch.float32)
        weight = resident(torch.ones(1 << 20))
        assert pool.abs().sum() == 0 and weight.sum() == 1 << 20
        return ["hg" in _vm_flags(t.data_ptr()) for t in (pool, weight)]

    monkeypatch.setenv("BATON_HUGE_PAGES", "1")
    assert advised() == [True, True]
    monkeypatch.setenv("BATON_HUGE_PAGES", "0")
    assert advised() == [False, False]
    monkeypatch.setenv("BATON_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match=r"\$BATON_HUGE_PAGES='yes'"):
        alloc_kv_pool((4, 16), torch.float32)
