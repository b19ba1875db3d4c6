"""``baton profile``: measures what this engine costs on this hardware (the measurements that
:mod:`baton.control.profile` describes and turns into a cost model): the bare engine in-process,
then real prefill and decode worker processes for the KV hand-off and the serving factors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence

from baton.control.profile import (
    BUSY_CLIENTS,
    BUSY_OUTPUT,
    BUSY_PROMPTS,
    DECODE_GRID,
    DECODE_ROUNDS,
    HANDOFF_TOKENS,
    LONE_GAPS,
    LONE_PROMPTS,
    LONE_ROUNDS,
    LONE_STREAMS,
    LONG_PROMPTS,
    PREFILL_PROMPT,
    PREFILL_ROUNDS,
    PREFILL_STREAMS,
    PREFILL_TOKENS,
    SAMPLING,
    SAMPLING_BATCH,
    SAMPLING_CONTEXT,
    SATURATED_PROMPTS,
    SERVED,
    SERVED_MANY,
    SERVED_ROUNDS,
    SERVED_TOKENS,
    STREAM_OUTPUT,
    STREAM_PROMPT,
    STREAM_SLOPE_ABOVE,
    VERSION,
    CostModel,
    Profile,
    ProfileError,
    default_path,
    prefill_factors,
    prefill_latency_factor,
    prefill_latency_factors,
    prefill_throughput_factor,
    tier_weights,
    utc_stamp,
)


def _times(fn: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    return statistics.median(_times(fn, repeats))


class _Prompts:
    """Fresh random prompts (no prefix-cache hits between measurements)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        import random

        self.rng, self.vocab = random.Random(seed), vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]


DEFAULT_MODEL = "default (SmolLM2-135M-Instruct)"  # a profile's model name for --model unset


def _prefill_lengths(n: int) -> list[int]:
    """The prompt lengths of the batched prefill table's ``n``-token step (PREFILL_PROMPT-token
    prompts, the remainder last)."""
    k = PREFILL_PROMPT
    return [k] * (n // k) + ([n % k] if n % k else [])


def _prefill_step(engine, prompts: _Prompts, lengths: list[int], params) -> None:
    """One prompt per length, prefilled: one step, or a long prompt's chunks."""
    for n in lengths:
        engine.add_request(prompt_token_ids=prompts(n), params=params)
    while engine.has_unfinished():
        engine.step()


def measure_engine(engine, repeats: int = 3, say: Callable[[str], None] = print) -> dict:
    """Batched prefill, long prefill and decode step times of ``engine`` (an LLMEngine)."""
    import torch
    from baton.engine.params import SamplingParams

    if engine.cfg.device_kind == "cpu":
        say(f"timing the engine: {torch.get_num_threads()} torch thread(s) on core(s) "
            f"{','.join(map(str, sorted(os.sched_getaffinity(0))))}")

    prompts = _Prompts(min(engine.model_config.vocab_size, 30000))
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    bs = engine.cfg.block_size

    def prefill_step(lengths: list[int]) -> None:
        _prefill_step(engine, prompts, lengths, one)

    out: dict = {"prefill": [], "prefill_long": [], "decode": [], "decode_fresh": []}
    sizes = {n: _prefill_lengths(n) for n in PREFILL_TOKENS}
    # warm-up: every size once, untimed. After one 8-token prompt only, the first rounds of
    # the 1- and 4-token steps on a 2-vCPU VM came out 20% above the later ones (30 ms against
    # 25), the decode grid's batch-1 steps 25-27 ms: tok(1) above a lone decode step, the cost
    # model's batch-1 decode steps 34-43% above its own grid, and a colocated pair's simulated
    # median TPOT 47 ms against a measured 29-30
    for lengths in sizes.values():
        prefill_step(lengths)
    # then PREFILL_ROUNDS rounds over the sizes, each point the median over all of them, so a
    # slow moment of the machine lands on every size alike rather than on a few
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(PREFILL_ROUNDS):
        for n, lengths in sizes.items():
            samples[n] += _times(lambda ls=lengths: prefill_step(ls), repeats)
    for n, lengths in sizes.items():
        s = statistics.median(samples[n])
        out["prefill"].append({"tokens": n, "requests": len(lengths), "s": s})
        say(f"prefill {n:5d} tokens in {len(lengths):3d} prompts: {s * 1000:8.2f} ms")
    limit = engine.max_model_len - 1  # room for the token each request samples
    for n in (n for n in LONG_PROMPTS if n <= limit):
        s = _median_time(lambda k=n: prefill_step([k]), repeats)
        out["prefill_long"].append({"tokens": n, "s": s})
        say(f"prefill one {n:5d}-token prompt:       {s * 1000:8.2f} ms")
    # the decode grid on a fresh pool (each request's blocks side by side, as on the profile's
    # freshly started workers: the serving factor's reference) and on a scattered one, as a pool
    # long in service is (the cost model's decode steps): in turn, DECODE_ROUNDS times, each
    # point the median over the rounds, so a slow moment of the machine lands on both grids
    # (measured one after the other on a 2-core VM, the fresh grid once came out up to 33%
    # above the scattered one, its serving factor 0.79, and the simulator under-predicted a
    # colocated pair's TPOT by a third)
    grid: dict[int, list[int]] = {}  # context -> the batches that fit
    for ctx, batches in DECODE_GRID.items():
        if ctx + 3 * repeats * len(batches) + 8 > limit:
            say(f"decode at context {ctx}: skipped (the model's context is {limit + 1})")
            continue
        grid[ctx] = [b for b in batches if b <= engine.cfg.max_num_seqs
                     and b * (ctx // bs + 2) <= engine.num_blocks]
    times: dict[tuple[str, int, int], list[float]] = {}
    for rnd in range(DECODE_ROUNDS):
        for key in ("decode_fresh", "decode"):
            if key == "decode":
                engine.kv.pool.scatter(rnd)
            else:
                engine.kv.pool.unscatter()
            for ctx, fits in grid.items():
                for batch, t in _decode_steps(engine, prompts, fits, ctx, 3 * repeats):
                    times.setdefault((key, ctx, batch), []).append(t)
    for (key, ctx, batch), ts in times.items():
        s = statistics.median(ts)
        out[key].append({"batch": batch, "context": ctx, "s": s})
        say(f"decode batch {batch:3d} x context {ctx:5d}, "
            f"{'scattered' if key == 'decode' else 'fresh'} pool: {s * 1000:8.2f} ms "
            f"(rounds {', '.join(f'{t * 1000:.1f}' for t in ts)})")
    if SAMPLING_CONTEXT + 3 * repeats + 8 <= limit:
        out["sampling"] = measure_sampling(engine, prompts, repeats, say)
    return out


def measure_sampling(engine, prompts, repeats: int = 3, say: Callable[[str], None] = print
                     ) -> dict:
    """What a sampled row adds to a step, per filter of the sampler (:data:`SAMPLING`): the
    logits of one decode step of :data:`SAMPLING_BATCH` streams at context
    :data:`SAMPLING_CONTEXT` (this model's own, on the CPU as the runner samples them), then
    the sampler on them all greedy and at each setting in turn, :data:`DECODE_ROUNDS` rounds of
    ``3 * repeats`` calls, each setting's median; temperature's share is its call over
    greedy's, each other filter's its call over temperature's, per row (none below 0). Timed
    apart from the step: a step's time moves by more than a row's sampling between two
    steps (temperature, ~0.15 ms a row beside a 52 ms step of 16 streams on a 2-vCPU VM, came
    out below zero as a difference of steps)."""
    import torch
    from baton.engine.params import SamplingParams
    from baton.engine.sampler import make_generator, sample

    runner, captured = engine.runner, []
    forward = runner._forward

    def keep(*args):
        captured.append(forward(*args))
        return captured[-1]

    runner._forward = keep  # this engine's next step hands its logits over as well
    try:
        _decode_steps(engine, prompts, [SAMPLING_BATCH], SAMPLING_CONTEXT, 1)
    finally:
        del runner._forward
    logits = captured[-1].float().cpu()
    assert logits.shape[0] == SAMPLING_BATCH, logits.shape
    modes = {"greedy": {"temperature": 0.0}, **SAMPLING}
    params = {name: [SamplingParams(max_tokens=1, **kw)] * SAMPLING_BATCH
              for name, kw in modes.items()}
    gens = [make_generator(i) for i in range(SAMPLING_BATCH)]
    times: dict[str, list[float]] = {name: [] for name in modes}
    for name in modes:  # warm-up
        sample(logits, params[name], gens)
    for _ in range(DECODE_ROUNDS):
        for name in modes:
            times[name] += _times(lambda ps=params[name]: sample(logits, ps, gens), 3 * repeats)
    call = {name: statistics.median(ts) for name, ts in times.items()}
    out = {name: max(0.0, (call[name] - call["greedy" if name == "temperature"
                                               else "temperature"]) / SAMPLING_BATCH)
           for name in SAMPLING}
    say(f"sampling {SAMPLING_BATCH} rows of {logits.shape[-1]} logits ({torch.get_num_threads()} "
        f"thread(s)): greedy {call['greedy'] * 1000:.2f} ms; a sampled row adds "
        + ", ".join(f"{name.replace('_', '-')} {v * 1000:.3f} ms" for name, v in out.items()))
    return out


def _decode_steps(engine, prompts, batches: list[int], ctx: int, repeats: int):
    """Median decode step time for each batch size (descending): prefill ``batches[0]``
    requests of ``ctx`` tokens once, then abort requests down to each next size."""
    from baton.engine.params import SamplingParams

    if not batches:
        return []
    params = SamplingParams(max_tokens=len(batches) * (repeats + 2) + 4, ignore_eos=True,
                            detokenize=False)
    reqs = [engine.add_request(prompt_token_ids=prompts(ctx), params=params)
            for _ in range(batches[0])]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    out = []
    for b in batches:
        for r in reqs[b:]:
            engine.abort(r.request_id)
        del reqs[b:]
        engine.step()  # collects the aborts; every request left is decoding
        out.append((b, _median_time(engine.step, repeats)))
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return out


def speed_probe(p: Profile, cores: list[int], repeats: int = 5,
                say: Callable[[str], None] = print) -> dict:
    """This machine's speed now against the day ``p`` was measured: its largest batched
    prefill step and its batch-16 decode step at context 128 on a fresh pool, timed again as
    :func:`run_profile` timed them (the engine pinned to the first ``p.threads`` of ``cores``
    with that many torch threads, a busy neighbour on the next). A shared VM's speed drifts
    by tens of percent in an hour; a validation measured while it ran slower than its profile
    says so, rather than counting the drift as the simulator's error. Ratios above 1: slower now."""
    import torch
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    model = None if p.model == DEFAULT_MODEL else p.model
    ref_prefill = max(p.prefill, key=lambda x: x["tokens"])
    ref_decode = next((x for x in p.decode_fresh if x["batch"] == 16 and x["context"] == 128),
                      None)
    n, lengths = ref_prefill["tokens"], _prefill_lengths(ref_prefill["tokens"])
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    mine = _groups(cores, p.threads)[0]
    others = sorted(set(cores) - mine)[:p.threads] if p.neighbors else []
    if p.neighbors and not others:
        say("the profile was measured beside a busy neighbour; with no other core there is "
            "none now, so this machine looks faster than it serves")
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, mine)
    engine = None
    try:
        engine = LLMEngine.from_path(model, _engine_config(EngineConfig, p.dtype, p.device,
                                                           threads=p.threads))
        prompts = _Prompts(min(engine.model_config.vocab_size, 30000), seed=7)
        with _neighbors(model, p.dtype, others, say, p.device, p.threads):
            _prefill_step(engine, prompts, lengths, one)  # warm-up
            pre = _median_time(lambda: _prefill_step(engine, prompts, lengths, one), repeats)
            dec = (dict(_decode_steps(engine, prompts, [16], 128, 3 * repeats)).get(16)
                   if ref_decode else None)
    finally:
        if engine is not None:
            engine.close()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    out = {"neighbour": bool(others), "prefill_tokens": n, "prefill_s": pre,
           "prefill_ratio": pre / ref_prefill["s"], "decode_16x128_s": dec,
           "decode_ratio": dec / ref_decode["s"] if dec and ref_decode else None}
    say(f"machine speed against the profile: {n}-token prefill step {pre * 1000:.0f} ms "
        f"({out['prefill_ratio']:.2f}x the profile's)"
        + (f", decode batch 16 {dec * 1000:.1f} ms ({out['decode_ratio']:.2f}x)"
           if out["decode_ratio"] else ""))
    return out


def measure_workers(model: str | None, dtype: str, cores: list[int], repeats: int = 3,
                    say: Callable[[str], None] = print,
                    max_model_len: int = 1 << 30, vocab: int = 10000, device: str = "cpu",
                    tp: int = 1, threads: int = 1
                    ) -> tuple[list[dict], list[dict], list[dict], list[dict], list[dict],
                               list[dict], list[dict]]:
    """Real prefill and decode worker processes (``threads`` cores each, or ``tp``): per prompt
    size, the time from the Prefill RPC's answer to the Decode stream's first chunk, and the KV
    bytes moved; then the decode worker's time per token with B concurrent streams (:data:`SERVED`)
    through a router, as clients reach it, while requests of :data:`BUSY_PROMPTS` tokens take the
    remote path one after another (both workers busy, the routers and the clients sharing their
    cores, as in a cluster near its goodput), in turn with the prefill worker idle (the routers and
    the clients have its core), and with it decoding too (:func:`_served_decoding`); then the
    prefill worker saturated on its own (:func:`_saturated_prefill`: each prompt's prefill call, as
    the router times it); then lone prompts through it (:func:`_lone_prefill`). Each round also
    times :data:`SERVED_MANY` in the three conditions. Returns the hand-offs, the served grid
    (busy), the saturated prefill rows, the served grid idle and decoding, the rows past it
    (each with its ``beside``) and the lone prompts' rows."""
    from baton.engine.params import SamplingParams
    from baton.services.common.protocol import params_to_proto
    from baton_client.v1 import api_pb2_grpc

    handoffs = [n for n in HANDOFF_TOKENS if n + 2 <= max_model_len]
    grid = [(c, b) for c, b in SERVED if c + SERVED_TOKENS[1] + 4 <= max_model_len]
    many = [(c, b) for c, b in SERVED_MANY if c + SERVED_TOKENS[1] + 4 <= max_model_len]
    fits = [n for n in LONG_PROMPTS if n < max_model_len]
    sizes = [n for n in BUSY_PROMPTS if n < max_model_len] or fits[-1:]
    common = _worker_args(model, dtype, device, tp, handoffs, grid + many, sizes, threads)
    say("starting a prefill and a decode worker and a router for the hand-off and serving "
        "measurements ...")
    prompts = _Prompts(min(vocab, 10000))
    params = params_to_proto(SamplingParams(max_tokens=2, ignore_eos=True))
    rows = []
    # stops the processes (last started first), then Redis, on every way out
    with contextlib.ExitStack() as stack:
        prefill, decode, router, remote = _start_cluster(stack, common,
                                                         _groups(cores, max(tp, threads)))
        for n in handoffs:
            rows.append(_handoff_time(prefill, decode, prompts, n, params, repeats))
            say(f"hand-off {n:5d} tokens ({rows[-1]['bytes'] / 2**20:6.1f} MiB): "
                f"{rows[-1]['s'] * 1000:8.2f} ms")
        rstub = api_pb2_grpc.BatonStub(router.channel)
        busy_stub = api_pb2_grpc.BatonStub(remote.channel)
        served, served_idle, served_decoding, served_many = [], [], [], []

        def timed() -> list[dict]:
            return [{"batch": b, "context": c, "s": _served_itl(rstub, prompts, c, b)}
                    for c, b in grid + many]

        # idle, busy, decoding in turn: a slow minute hits all; --repeats 1 (a quick, rough
        # profile) times the grid once
        for i in range(min(SERVED_ROUNDS, repeats)):
            idle_rows = timed()
            with _busy_prefill(busy_stub, _Prompts(min(vocab, 10000), seed=1 + i), sizes):
                busy_rows = timed()
            decoding_rows = _served_decoding(prefill, rstub, prompts, grid + many)
            for got, into, cond in ((idle_rows, served_idle, "idle"), (busy_rows, served, "busy"),
                                    (decoding_rows, served_decoding, "decoding")):
                into += got[:len(grid)]
                served_many += [{**r, "beside": cond} for r in got[len(grid):]]
        busy = []
        for streams in PREFILL_STREAMS:
            say(f"the prefill worker saturated: {SATURATED_PROMPTS} prompts of "
                f"{'/'.join(map(str, sizes))} tokens, {BUSY_OUTPUT} tokens out each, "
                f"{streams} other streams meanwhile ...")
            busy += _saturated_prefill(busy_stub, rstub, _Prompts(min(vocab, 10000),
                                                                  seed=2 + len(busy)),
                                       sizes, streams)
        lone, lengths = [], [n for n in LONE_PROMPTS if n + BUSY_OUTPUT + 2 <= max_model_len]
        for _ in range(min(LONE_ROUNDS, repeats) if lengths else 0):
            for streams in LONE_STREAMS:
                say(f"lone prompts of {'/'.join(map(str, lengths))} tokens, each after "
                    f"{' or '.join(f'{g:g}' for g in LONE_GAPS)} s idle, {streams} other "
                    "streams meanwhile ...")
                lone += _lone_prefill(busy_stub, rstub,
                                      _Prompts(min(vocab, 10000), seed=100 + len(lone)),
                                      lengths, streams)
    _say_served(say, served, served_idle, served_decoding, served_many, busy, sizes)
    return rows, served, busy, served_idle, served_decoding, served_many, lone


def _served_decoding(prefill, rstub, prompts: _Prompts, grid: list[tuple[int, int]]
                     ) -> list[dict]:
    """The served grid with the other worker decoding as well: ``prefill`` switched to the
    decode role (``WorkerAdmin.SetRole``, as `baton role`), twice each point's streams through
    the router, which splits them over the two workers (B each, both prefilling their own
    prompts first, as two colocated workers), then switched back. After each switch it waits
    out the routers' registry refresh, so they route by the new role before anything else is
    sent."""
    from baton.control.tune_live import set_role
    from baton.services.router.workers import REFRESH_S

    def switch(role: str) -> None:
        try:
            set_role(prefill.address, role)
        except RuntimeError as e:  # the worker or Redis refused: the profile cannot go on
            raise ProfileError(f"switching the prefill worker to {role} for the served grid "
                               f"beside a decoding worker: {e}") from None
        time.sleep(1.5 * REFRESH_S)

    switch("decode")
    try:
        return [{"batch": b, "context": c, "s": _served_itl(rstub, prompts, c, 2 * b)}
                for c, b in grid]
    finally:
        switch("prefill")


def _worker_args(model: str | None, dtype: str, device: str, tp: int, handoffs: list[int],
                 grid: list[tuple[int, int]], busy: Sequence[int] = (), threads: int = 1
                 ) -> list[str]:
    """The measuring workers' flags: ``threads`` torch threads, no metrics, a pool that holds the
    largest hand-off, and every stream of the served grid beside a hand-off of the largest ``busy``
    prompt for each of the :data:`BUSY_CLIENTS` that keep the prefill worker busy meanwhile. (A pool
    that held the grid's largest point alone left those hand-offs waiting for room while its streams
    prefilled: on a 2-vCPU VM, past the decode worker's 10 s `--transfer-timeout` for one, whose
    client then failed the serving check.)"""
    room = BUSY_CLIENTS * ((max(busy) + BUSY_OUTPUT) // 16 + 2) if busy else 0
    args = ["--dtype", dtype, "--threads", str(threads), "--metrics-port", "-1", "--device", device,
            "--tensor-parallel-size", str(tp),
            *(["--gpu-memory-utilization", "0.3"] if device.startswith("cuda") else []),
            "--num-blocks", str(max([4 * (max(handoffs, default=0) // 16 + 2),
                                     *(b * ((c + SERVED_TOKENS[1]) // 16 + 4) + room
                                       for c, b in grid)]))]
    return [*args, "--model", model] if model else args


def serving_factors(p: Profile, served: list[dict], busy: list[dict], lone: list[dict],
                    decoding: Sequence[dict] = ()) -> dict:
    """A serving check's factors and their ratios to ``p``'s (:func:`serving_probe`): the
    served decode grid's median over the model (``served``) against ``p``'s decode factor
    (the other worker prefilling), the grid beside a decoding worker (``decoding``) against
    ``p``'s ``serving_factor_decoding`` where both have it (``decode_ratio_decoding``, which
    then scales that factor, the one two colocated workers decode at, on its own), the
    saturated prefill window's throughput factor (``busy``) and the lone prompts' latency factor
    (``lone``) against ``p``'s prefill factors of their kind with nothing streamed (a version-10
    profile's ``prefill_factor`` is lone prompts' latency, its saturated throughput kept as
    ``prefill_factor_saturated``; before, ``prefill_factor`` was the saturated one). Against the
    factors, not the rows they were fitted on: a profile a check has scaled already is checked
    against what it now says. ``prefill_ratio``, the one that scales the profile, is the lone
    prompts' where both the check and the profile have them (``prefill_from``: ``lone``), else
    the saturated window's. Where the check also timed lone prompts with other streams running
    (rows with ``streams`` above 0) and the profile's latency factor rises with streaming
    (``prefill_stream_factor`` above 0), ``prefill_ratio`` is the line's intercept's (the check's
    line through its windows, :func:`prefill_latency_factors`, against the profile's) and
    ``prefill_stream_ratio`` its rise's, each scaling its own part (``prefill_from``:
    ``lone+streams``); the ratio of the windows with nothing streamed alone is kept as
    ``prefill_ratio_idle``. On 2026-12-06 a prefill worker beside a streaming decode worker ran
    1.26x the profile's simulation where lone prompts with nothing streamed read 1.05x."""
    engine_cost = CostModel(p)
    fresh_cost = CostModel(dataclasses.replace(p, decode=p.decode_fresh or p.decode))

    def ratio(now: float | None, was: float | None) -> float | None:
        return now / was if now and was else None

    def grid_factor(rows: Sequence[dict]) -> float:  # a served decode grid over the model
        return statistics.median(r["s"] / _served_model_s(fresh_cost, r) for r in rows)

    has_lone = p.prefill_factor_saturated is not None
    out = {"decode_factor": grid_factor(served),
           "decode_factor_profile": p.serving_factor,
           "prefill_factor_saturated": prefill_throughput_factor(busy, engine_cost.engine_prompt),
           "prefill_factor_saturated_profile": (p.prefill_factor_saturated if has_lone
                                                else p.prefill_factor)}
    out["decode_ratio"] = out["decode_factor"] / out["decode_factor_profile"]
    if decoding and p.serving_factor_decoding:
        out["decode_factor_decoding"] = grid_factor(decoding)
        out["decode_factor_decoding_profile"] = p.serving_factor_decoding
        out["decode_ratio_decoding"] = (out["decode_factor_decoding"]
                                        / p.serving_factor_decoding)
    out["prefill_ratio_saturated"] = ratio(out["prefill_factor_saturated"],
                                           out["prefill_factor_saturated_profile"])
    idle = [r for r in lone if not r.get("streams")]
    lone_now = prefill_latency_factor(idle, engine_cost.engine_prompt)
    kind = "lone" if lone_now and has_lone else "saturated"
    out.update({"prefill_from": kind,
                "prefill_factor": lone_now if kind == "lone" else out["prefill_factor_saturated"],
                "prefill_factor_profile": (p.prefill_factor if kind == "lone"
                                           else out["prefill_factor_saturated_profile"])})
    out["prefill_ratio"] = ratio(out["prefill_factor"], out["prefill_factor_profile"])
    line = prefill_latency_factors(lone, engine_cost.engine_prompt)
    if (kind == "lone" and p.prefill_stream_factor > 0 and len(idle) < len(lone)
            and line and line[0] > 0):
        out.update({"prefill_from": "lone+streams", "prefill_ratio_idle": out["prefill_ratio"],
                    "prefill_factor": line[0], "prefill_stream_factor": line[1],
                    "prefill_stream_factor_profile": p.prefill_stream_factor,
                    "prefill_ratio": line[0] / p.prefill_factor,
                    "prefill_stream_ratio": line[1] / p.prefill_stream_factor,
                    "streamed_tps": statistics.fmean(r["streamed_tps"] for r in lone
                                                     if r.get("streams"))})
    return out


def serving_probe(p: Profile, cores: list[int], say: Callable[[str], None] = print) -> dict:
    """This machine's serving factors now against ``p``'s: real workers as :func:`measure_workers`
    starts them, the served decode grid once (the prefill worker busy meanwhile), one window
    of the prefill worker saturated with nothing else streaming and, for a profile whose
    prefill factors are lone prompts' latency (version 10), one window of lone prompts with
    nothing streamed, each against ``p``'s bare engine. The bare engine's speed
    (:func:`speed_probe`) can hold while a serving worker's overheads move: on a 2-core VM two
    profiles of one day timed the bare engine within 1% and the serving factors 6-9% apart.
    ``prefill_ratio`` is the ratio of the kind of factor the profile's prefill factors are (the
    lone prompts' where it has them; the saturated window's ratio kept beside as
    ``prefill_ratio_saturated``): on 2026-12-06 a saturated window read 1.00x while the bare
    engine and the calibration on the run's window read 1.05x. Ratios above 1: slower now.
    ~2.5 minutes on a 2-vCPU VM."""
    from baton.engine.loader import load_config
    from baton_client.v1 import api_pb2_grpc

    if not p.served or not p.served_prefill:
        raise ProfileError("the profile has no serving measurements (measured with "
                           "--no-handoff): nothing to check them against")
    model = None if p.model == DEFAULT_MODEL else p.model
    tp = p.tensor_parallel_size
    grid = list(dict.fromkeys((r["context"], r["batch"]) for r in p.served))  # one round
    sizes = sorted({r["tokens"] for r in p.served_prefill})
    common = _worker_args(model, p.dtype, p.device, tp, [], grid, sizes, p.threads)
    vocab = min(load_config(model).vocab_size, 10000)  # as measure_workers draws its prompts
    prompts = _Prompts(vocab)
    say("starting a prefill and a decode worker and two routers for the serving check ...")
    with contextlib.ExitStack() as stack:
        prefill, _, router, remote = _start_cluster(stack, common,
                                                    _groups(cores, max(tp, p.threads)))
        rstub = api_pb2_grpc.BatonStub(router.channel)
        busy_stub = api_pb2_grpc.BatonStub(remote.channel)
        with _busy_prefill(busy_stub, _Prompts(vocab, seed=1), sizes):
            served = [{"batch": b, "context": c, "s": _served_itl(rstub, prompts, c, b)}
                      for c, b in grid]
        decoding = []
        if p.served_decoding:  # as two colocated workers decode
            say("the served decode grid again beside a decoding worker ...")
            decoding = _served_decoding(prefill, rstub, prompts,
                                        list(dict.fromkeys((r["context"], r["batch"])
                                                           for r in p.served_decoding)))
        say(f"the prefill worker saturated: {SATURATED_PROMPTS} prompts of "
            f"{'/'.join(map(str, sizes))} tokens, {BUSY_OUTPUT} tokens out each ...")
        busy = _saturated_prefill(busy_stub, rstub, _Prompts(vocab, seed=2), sizes, 0)
        lengths = sorted({r["tokens"] for r in p.lone_prefill})
        lone = []
        for streams in sorted({r.get("streams", 0) for r in p.lone_prefill}):
            say(f"lone prompts of {'/'.join(map(str, lengths))} tokens, each after "
                f"{' or '.join(f'{g:g}' for g in LONE_GAPS)} s idle, "
                + (f"{streams} other streams meanwhile ..." if streams else
                   "nothing streamed ..."))
            lone += _lone_prefill(busy_stub, rstub, _Prompts(vocab, seed=3 + streams), lengths,
                                  streams)

    out = serving_factors(p, served, busy, lone, decoding)
    kind = out["prefill_from"]
    lone_kind = kind.startswith("lone")
    say(f"serving factors against the profile's: decode {out['decode_factor']:.3f} "
        f"({out['decode_ratio']:.2f}x the profile's {out['decode_factor_profile']:.3f})"
        + (f", beside a decoding worker {out['decode_factor_decoding']:.3f} "
           f"({out['decode_ratio_decoding']:.2f}x the profile's "
           f"{out['decode_factor_decoding_profile']:.3f})" if "decode_ratio_decoding" in out
           else "")
        + (f", prefill {'of lone prompts' if lone_kind else 'saturated'} with nothing "
           f"streamed {out['prefill_factor']:.3f} "
           f"({out['prefill_ratio']:.2f}x the profile's {out['prefill_factor_profile']:.3f})"
           if out["prefill_ratio"] else "")
        + (f"; the saturated worker {out['prefill_ratio_saturated']:.2f}x"
           if lone_kind and out["prefill_ratio_saturated"] else ""))
    if kind == "lone+streams":
        say(f"lone prompts' prefill against streaming: {out['prefill_factor']:.3f} + "
            f"{out['prefill_stream_factor'] * 100:.4f} per 100 tokens a second streamed "
            f"({out['prefill_ratio']:.2f}x and {out['prefill_stream_ratio']:.2f}x the "
            f"profile's {out['prefill_factor_profile']:.3f} + "
            f"{out['prefill_stream_factor_profile'] * 100:.4f}; with nothing streamed "
            f"{out['prefill_ratio_idle']:.2f}x)")
    return out


def _remote_prefill_timing(rstub, ids: list[int], params):
    """One request through ``rstub``; its final message's timing (it must take the remote
    path)."""
    from baton_client.v1 import api_pb2

    final = None
    for m in rstub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids),
                                                    params=params), timeout=300):
        if m.HasField("final"):
            final = m.final
    if final is None or final.path != "remote":
        raise ProfileError(f"a {len(ids)}-token prompt took the "
                           f"{final.path if final else 'no'} path, not remote")
    return final.timing


def _say_served(say, served: list[dict], served_idle: list[dict], served_decoding: list[dict],
                served_many: list[dict], busy: list[dict], sizes) -> None:
    def cond(c: str) -> list[dict]:
        return [r for r in served_many if r["beside"] == c]

    for r, q, d in [*zip(served, served_idle, served_decoding),
                    *zip(cond("busy"), cond("idle"), cond("decoding"))]:
        say(f"served decode {r['batch']:3d} streams x context {r['context']:5d}: "
            f"{r['s'] * 1000:8.2f} ms a token, {q['s'] * 1000:8.2f} with the prefill worker "
            f"idle, {d['s'] * 1000:8.2f} with it decoding as many")
    for n in sizes:
        ss = [r["s"] for r in busy if r["tokens"] == n]
        say(f"served prefill {n:5d} tokens, queue never empty: {len(ss)} prompts, median "
            f"{statistics.median(ss) * 1000 if ss else float('nan'):8.2f} ms")


def _start_cluster(stack: contextlib.ExitStack, common: list[str], groups: list[set[int]]):
    """Redis, a prefill and a decode worker (a core group each) and two routers, each stopped by
    ``stack``: (prefill, decode, the streams' router, the busy prompts' router)."""
    from baton.control.redis_server import EmbeddedRedis
    from baton.services.launch.local import WorkerProcess

    redis = stack.enter_context(EmbeddedRedis(die_with_parent=True))
    common = [*common, "--redis-url", redis.url]

    def start(role: str, args: list[str], cpus: set[int] | None = None) -> WorkerProcess:
        proc = WorkerProcess(role, args, cpus=cpus, die_with_parent=True)  # a killed profile's too
        stack.callback(proc.stop)
        return proc

    prefill = start("prefill", common, groups[0])
    decode = start("decode", [*common, "--peers", prefill.address], groups[1])
    # the streams' router prefills every prompt on the decode worker, so the streams are all
    # decoding by the timed window; the busy prompts take the remote path through a router of
    # their own: prefill, KV hand-off, lease release, decode, as in a cluster
    router = start("router", ["--redis-url", redis.url, "--http-port", "-1",
                              "--local-prefill-max-tokens", "1000000"])
    remote = start("router", ["--redis-url", redis.url, "--http-port", "-1",
                              "--local-prefill-max-tokens", "0"])
    return prefill, decode, router, remote


def _handoff_time(prefill, decode, prompts, n: int, params, repeats: int) -> dict:
    """An ``n``-token prompt's hand-off: from the Prefill answer to the Decode stream's first
    chunk, median of ``repeats`` (after one that pays the connection set-up)."""
    from baton.v1 import worker_pb2, worker_pb2_grpc

    pstub = worker_pb2_grpc.PrefillWorkerStub(prefill.channel)
    dstub = worker_pb2_grpc.DecodeWorkerStub(decode.channel)
    samples, nbytes = [], None
    for i in range(repeats + 1):
        ids, rid = prompts(n), f"profile-{n}-{i}"
        pre = pstub.Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, params=params), timeout=120)
        t0 = time.perf_counter()
        nbytes = None
        for chunk in dstub.Decode(worker_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=ids, first_token_id=pre.first_token_id,
                params=params, handle=pre.handle), timeout=60):
            if nbytes is None:
                samples.append(time.perf_counter() - t0)
                nbytes = chunk.transfer.bytes
    return {"tokens": n, "bytes": nbytes, "s": statistics.median(samples[1:])}


@contextlib.contextmanager
def _busy_prefill(rstub, prompts: _Prompts, sizes: Sequence[int], clients: int = BUSY_CLIENTS,
                  output: int = 2, enough: tuple[int, threading.Event] | None = None):
    """Keeps the prefill worker busy for the duration of a ``with``: ``clients`` threads send
    requests of ``sizes``-token prompts in turn, ``output`` tokens each, through ``rstub`` (a
    router that sends every prompt to the prefill worker). Yields the list it fills with each
    prompt's prefill call (the router's ``prefill_s`` less the prefill worker's queue) and the
    wall time its prefill ended (``end``), each client's first round left out (warm-up).
    ``enough`` (N, event): the event is set once N prompts are in the list, or a client failed."""
    from concurrent.futures import ThreadPoolExecutor

    from baton.engine.params import SamplingParams
    from baton.services.common.protocol import params_to_proto

    params = params_to_proto(SamplingParams(max_tokens=output, ignore_eos=True))
    rows: list[dict] = []
    stop = threading.Event()
    lock = threading.Lock()

    def run(client: int) -> None:
        try:
            for i in itertools.count(client):
                if stop.is_set() or not sizes:
                    return
                n = sizes[i % len(sizes)]
                with lock:
                    ids = prompts(n)
                sent = time.monotonic()
                t = _remote_prefill_timing(rstub, ids, params)
                if i >= client + len(sizes):
                    with lock:
                        rows.append({"tokens": n, "s": t.prefill_s - t.queue_s,
                                     "end": sent + t.route_s + t.prefill_s})
                        if enough is not None and len(rows) >= enough[0]:
                            enough[1].set()
        finally:  # a failed client ends the wait too (its error is raised on the way out)
            if enough is not None and not stop.is_set():
                enough[1].set()

    with ThreadPoolExecutor(clients) as ex:
        done = [ex.submit(run, c) for c in range(clients)]
        try:
            yield rows
        finally:
            stop.set()
        for d in done:  # reached only when the body succeeded: its error comes first
            error = d.exception()
            if error is not None:
                raise ProfileError(f"the busy prefill worker failed: {error}") from error


def _saturated_prefill(busy_stub, rstub, prompts: _Prompts, sizes: Sequence[int],
                       streams: int) -> list[dict]:
    """:data:`SATURATED_PROMPTS` prompts' rows (as :func:`_busy_prefill`'s) from the prefill
    worker with its queue never empty, each prompt's hand-off and :data:`BUSY_OUTPUT` tokens
    decoded and streamed to its client, while ``streams`` other streams run through ``rstub``
    (decoded on the decode worker: the router and the clients relay their tokens on the
    machine's cores); each row carries the window's ``streamed_tps``, those streams' tokens a
    second."""
    enough = threading.Event()
    with _streaming(rstub, prompts, streams) as count:
        t0, n0 = time.monotonic(), count[0]
        with _busy_prefill(busy_stub, prompts, sizes, output=BUSY_OUTPUT,
                           enough=(SATURATED_PROMPTS, enough)) as rows:
            enough.wait()
        tps = (count[0] - n0) / (time.monotonic() - t0)
    return [{**r, "streams": streams, "streamed_tps": round(tps, 1)} for r in rows]


def _lone_prefill(busy_stub, rstub, prompts: _Prompts, lengths: Sequence[int], streams: int
                  ) -> list[dict]:
    """One window of the latency prefill factors: each of ``lengths`` prompts sent alone
    through ``busy_stub`` (the router that sends every prompt to the prefill worker), once
    after each of :data:`LONE_GAPS` seconds with nothing sent, :data:`BUSY_OUTPUT` tokens
    decoded each, while ``streams`` other streams run through ``rstub``. A row per prompt:
    its prefill call as the router times it less its queue (``s``; ``queue_s`` beside, ~0),
    the gap before it, and the window's ``streams`` and ``streamed_tps``. One prompt first,
    not kept: the streams' first prefills on the decode worker run meanwhile."""
    from baton.engine.params import SamplingParams
    from baton.services.common.protocol import params_to_proto

    params = params_to_proto(SamplingParams(max_tokens=BUSY_OUTPUT, ignore_eos=True))
    own = _Prompts(prompts.vocab, seed=prompts.rng.randrange(1 << 30))  # the streams draw too
    rows = []
    with _streaming(rstub, prompts, streams) as count:
        _remote_prefill_timing(busy_stub, own(lengths[0]), params)
        t0, n0 = time.monotonic(), count[0]
        for gap in LONE_GAPS:
            for n in lengths:
                time.sleep(gap)  # the prefill worker idle this long (its last request done)
                t = _remote_prefill_timing(busy_stub, own(n), params)
                rows.append({"tokens": n, "s": t.prefill_s - t.queue_s, "queue_s": t.queue_s,
                             "gap": gap})
        tps = (count[0] - n0) / (time.monotonic() - t0)
    return [{**r, "streams": streams, "streamed_tps": round(tps, 1)} for r in rows]


@contextlib.contextmanager
def _streaming(rstub, prompts: _Prompts, streams: int, ctx: int = STREAM_PROMPT):
    """``streams`` Generate streams of ``ctx``-token prompts, each followed by another as it
    ends, for the duration of a ``with``; yields a one-item list counting their tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from baton.engine.params import SamplingParams
    from baton.services.common.protocol import params_to_proto
    from baton_client.v1 import api_pb2

    params = params_to_proto(SamplingParams(max_tokens=STREAM_OUTPUT, ignore_eos=True))
    count, stop, lock = [0], threading.Event(), threading.Lock()

    def run() -> None:
        while not stop.is_set():
            with lock:
                ids = prompts(ctx)
            call = rstub.Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=ids), params=params), timeout=300)
            for m in call:
                if m.HasField("delta"):
                    with lock:
                        count[0] += len(m.delta.token_ids)
                if stop.is_set():
                    call.cancel()
                    break

    with ThreadPoolExecutor(max(1, streams)) as ex:
        done = [ex.submit(run) for _ in range(streams)]
        try:
            yield count
        finally:
            stop.set()
        for d in done:  # a stream it cancelled ended without an error
            error = d.exception()
            if error is not None:
                raise ProfileError(f"a stream beside the prefill worker failed: {error}")


def _served_itl(rstub, prompts, ctx: int, streams: int) -> float:
    """Median over ``streams`` concurrent Generate streams (through the router ``rstub``) of
    ``ctx``-token prompts of the time per token between tokens :data:`SERVED_TOKENS` (every
    stream is decoding by then)."""
    from concurrent.futures import ThreadPoolExecutor

    from baton.engine.params import SamplingParams
    from baton.services.common.protocol import params_to_proto
    from baton_client.v1 import api_pb2

    lo, hi = SERVED_TOKENS
    params = params_to_proto(SamplingParams(max_tokens=hi + 4, ignore_eos=True))
    requests = [api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts(ctx)),
                                        params=params) for _ in range(streams)]

    def one(request) -> float:
        stamps: list[float] = []
        for m in rstub.Generate(request, timeout=300):
            if m.HasField("delta"):
                stamps += [time.perf_counter()] * len(m.delta.token_ids)
        return (stamps[hi] - stamps[lo]) / (hi - lo)

    with ThreadPoolExecutor(streams) as ex:  # all at once; a stream's error is raised here
        return statistics.median(ex.map(one, requests))


def neighbor_load(model: str, dtype: str, cores: str, device: str = "cpu",
                  threads: str = "1") -> None:
    """What a busy worker does to its neighbours' caches and memory bandwidth: one engine
    (``threads`` torch threads, pinned to ``cores``) serving 512-token prompts with 64 tokens
    each, eight in flight, until it is killed. Run by :func:`run_profile` in a process of its
    own."""
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    engine = LLMEngine.from_path(model or None, _engine_config(EngineConfig, dtype, device,
                                                              share=0.3, threads=int(threads)))
    prompts = _Prompts(min(engine.model_config.vocab_size, 30000))
    params = SamplingParams(max_tokens=64, ignore_eos=True, detokenize=False)
    n = min(512, engine.max_model_len - 64)
    live: list = []
    for step in itertools.count():
        live = [r for r in live if not r.is_finished]
        while len(live) < 8:
            live.append(engine.add_request(prompt_token_ids=prompts(n), params=params))
        engine.step()
        if step == 0:
            print("ready", flush=True)


@contextlib.contextmanager
def _neighbors(model: str | None, dtype: str, cores: list[int], say: Callable[[str], None],
               device: str = "cpu", threads: int = 1):
    """:func:`neighbor_load` on ``cores`` (none: nothing) with ``threads`` torch threads, for
    the duration of a ``with``."""
    import subprocess

    from baton.services.launch.local import spawn

    if not cores:
        yield
        return
    cores_arg = ",".join(map(str, cores))
    say(f"starting a busy engine on core(s) {cores_arg} as the neighbour ...")
    # it never stops on its own: SIGTERM when this process dies, however it dies (one left
    # by a `baton profile` stopped with SIGTERM ran through the next profile's serving part)
    proc = spawn(
        [sys.executable, "-c", "import sys; from baton import adopt_launch_settings; "
         "adopt_launch_settings(); from baton.bench.profile import neighbor_load; "
         "neighbor_load(*sys.argv[1:])", model or "", dtype, cores_arg, device, str(threads)],
        os.environ, stdout=subprocess.PIPE, die_with_parent=True)
    try:
        if proc.stdout.readline().strip() != b"ready":
            raise ProfileError("the neighbour load did not start (see its error above)")
        yield
    finally:
        proc.kill()
        proc.wait()


TIER_BLOCKS = 64  # blocks per timed load: a 1,024-token prefix at 16 tokens a block


def measure_tiers(engine, repeats: int = 3, say: Callable[[str], None] = print) -> list[dict]:
    """Loading ``TIER_BLOCKS`` blocks back into a pool from each KV tier (``kv_tiers``): a host
    tier, and a disk tier in a scratch directory (read back from the file, checksums checked;
    the page cache holds what was just written, as it holds a busy worker's recent
    evictions). The router's tier weights come from these against the prefill cost."""
    import tempfile

    import torch
    from baton.engine.kv_tiers import DiskTier, HostTier, TierStore, disk_tier_bytes

    kv = engine.kv_cache
    shape, n = kv.shape[1:], min(TIER_BLOCKS, engine.num_blocks)
    scratch = torch.zeros((n, *shape), dtype=kv.dtype, device=kv.device)
    hashes = [i.to_bytes(32, "little") for i in range(n)]
    data = torch.randn((n, *shape)).to(kv.dtype)
    out = []
    with tempfile.TemporaryDirectory(prefix="baton-profile-tier-") as d:
        host = HostTier(n, shape, kv.dtype, pin=kv.device.type == "cuda")
        disk = DiskTier(d, disk_tier_bytes(n, data[0].nbytes), shape, kv.dtype, "profile",
                        max_pending=n)
        for tier in (host, disk):
            for h, block in zip(hashes, data):
                tier.put(h, block.clone())
            if tier is disk:
                disk.flush()
            store = TierStore(scratch, [tier])
            s = _median_time(lambda st=store: st.load(hashes, range(n)), repeats)
            assert torch.equal(scratch.cpu(), data), f"{tier.name} tier loaded other bytes"
            out.append({"tier": tier.name, "blocks": n, "bytes": n * data[0].nbytes, "s": s})
            say(f"load {n} blocks from the {tier.name} tier: {s * 1000:8.2f} ms "
                f"({n * data[0].nbytes / s / 1e9:.2f} GB/s)")
        disk.close()
    return out


def resolve_device(device: str) -> str:
    """``--device`` as a worker resolves it (auto: cuda when a GPU is visible, else cpu);
    raises ProfileError for a GPU this process cannot see."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ProfileError(f"--device {device}: no GPU is visible to this process "
                           "(CUDA_VISIBLE_DEVICES, the driver, or a CPU-only build of torch)")
    return device


def _engine_config(EngineConfig, dtype: str, device: str, share: float = 0.4, tp: int = 1,
                   threads: int = 1):
    """``threads`` torch threads (per rank), on ``device``; on a GPU a ``share`` of its memory,
    so the engine, its neighbour and the hand-off's two workers fit on one GPU together."""
    kw = {"gpu_memory_utilization": share} if device.startswith("cuda") else {}
    return EngineConfig(dtype=dtype, num_threads=threads, device=device, tensor_parallel_size=tp,
                        **kw)


def _groups(cores: list[int], width: int) -> list[set[int]]:
    """Two groups of ``width`` cores (a worker's ranks, or its torch threads: the engine's, or
    the prefill worker's, then the neighbour's or the decode worker's), wrapping round
    ``cores`` when there are fewer than 2 x width."""
    return [{cores[(g * width + i) % len(cores)] for i in range(width)} for g in range(2)]


def run_profile(model: str | None, dtype: str, cores: list[int], repeats: int = 3,
                handoff: bool = True, say: Callable[[str], None] = print,
                neighbors: bool = True, device: str = "cpu", tp: int = 1,
                threads: int = 1) -> Profile:
    """Measure this machine: the engine in this process pinned to the first ``threads`` of
    ``cores`` with that many torch threads (one: as `baton bench compare` and `baton up
    --threads 1` run workers; N: as `baton up --threads N`), then the hand-off.
    With ``neighbors``, an engine as busy as a serving worker runs on the other cores meanwhile:
    near its goodput every worker of a cluster is busy, and on a 2-core VM a busy neighbour made
    a 1024-token prefill 8-13% slower than on an idle machine. ``device``: where the engine,
    the neighbour and the workers run (cpu, cuda, cuda:N; the workers' --device), recorded in
    the profile: costs measured on one device say nothing of another. ``tp``: measure a
    worker of that many ranks (each on a core of its own on the CPU), for a pool of that
    tensor-parallel size in `baton tune` (``threads`` stays 1 then)."""
    import torch
    from baton.bench.common import machine
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine

    if tp > 1 and threads > 1:
        raise ProfileError("a worker of several ranks runs one torch thread a rank: measure "
                           "--tensor-parallel-size or --threads, not both")
    width = max(tp, threads)
    mine = _groups(cores, width)[0]
    others = sorted(set(cores) - mine)[:width] if neighbors else []
    affinity, caller_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, mine)  # the group's followers start from it
    try:
        say(f"loading the model ({dtype}, {device}) ...")
        engine = LLMEngine.from_path(model, _engine_config(EngineConfig, dtype, device, tp=tp,
                                                           threads=threads))
        with _neighbors(model, dtype, others, say, device, threads):
            costs = measure_engine(engine, repeats, say)
            costs["tier_load"] = measure_tiers(engine, repeats, say)
    finally:  # the caller's cores and threads back (its later workers pin themselves)
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(caller_threads)
    from baton.engine.config import processor

    p = Profile(model=model or DEFAULT_MODEL, dtype=dtype, threads=threads,
                block_size=engine.cfg.block_size,
                max_num_batched_tokens=engine.cfg.max_num_batched_tokens,
                max_num_seqs=engine.cfg.max_num_seqs, num_blocks=engine.num_blocks,
                kv_bytes_per_token=engine.block_nbytes // engine.cfg.block_size,
                neighbors=others, machine={**machine(), "processor": processor(engine.cfg.device)},
                device=device, tensor_parallel_size=tp,
                fingerprint=engine.fingerprint, model_name=engine.model_info.name, **costs)
    engine_len, vocab = engine.max_model_len, engine.model_config.vocab_size
    engine.close()  # a group's followers end with it
    del engine
    if handoff:
        (p.handoff, p.served, p.served_prefill, p.served_idle, p.served_decoding,
         p.served_many, p.lone_prefill) = measure_workers(
            model, dtype, cores, repeats, say, engine_len, vocab, device, tp, threads)
        _serving_factors(p, say)
    p.measured_at = utc_stamp()
    weights = tier_weights(p)
    if weights:
        say("KV tier weights for the router (the share of a block's prefill time a load saves): "
            + ", ".join(f"{k}={v}" for k, v in weights.items()))
    return p


def _served_model_s(fresh_cost: CostModel, row: dict) -> float:
    """The bare engine's decode step (on a fresh pool) for a served row's streams, at the middle
    of the window :func:`_served_itl` times."""
    mid = row["context"] + sum(SERVED_TOKENS) // 2
    return fresh_cost.engine_step(row["batch"], 0, [mid] * row["batch"])


def _serving_factors(p: Profile, say: Callable[[str], None]) -> None:
    """A serving worker's time over the bare engine's, for decode and prefill (into ``p``)."""
    engine_cost = CostModel(p)
    # the profile's workers are freshly started, their pools unscattered: their decode steps
    # against the bare engine's on a fresh pool
    fresh_cost = CostModel(dataclasses.replace(p, decode=p.decode_fresh or p.decode))
    for r in [*p.served, *p.served_idle, *p.served_decoding, *p.served_many]:
        r["model_s"] = _served_model_s(fresh_cost, r)
    for r in [*p.served_prefill, *p.lone_prefill]:
        r["model_s"] = engine_cost.engine_prompt(r["tokens"])
    if p.served:
        p.serving_factor = statistics.median(r["s"] / r["model_s"] for r in p.served)
    if p.served_idle:
        p.serving_factor_idle = statistics.median(r["s"] / r["model_s"] for r in p.served_idle)
    if p.served_decoding:
        p.serving_factor_decoding = statistics.median(r["s"] / r["model_s"]
                                                      for r in p.served_decoding)
    slopes = stream_slopes(p)
    rises = slopes["busy"] + slopes["decoding"]
    p.serving_stream_slope = max(0.0, statistics.median(rises)) if rises else 0.0
    fit = prefill_factors(p.served_prefill, engine_cost.engine_prompt)
    if fit is None:
        p.prefill_factor, p.prefill_stream_factor = p.serving_factor, 0.0
    else:
        p.prefill_factor, p.prefill_stream_factor = fit
    lone = prefill_latency_factors(p.lone_prefill, engine_cost.engine_prompt)
    if lone is not None:  # the simulator charges a prompt its latency, the throughput kept
        p.prefill_factor_saturated = p.prefill_factor
        p.prefill_stream_factor_saturated = p.prefill_stream_factor
        p.prefill_factor, p.prefill_stream_factor = lone
        say(f"lone prompts: {p.prefill_factor:.3f} + {p.prefill_stream_factor * 100:.4f} per "
            "100 tokens a second streamed (their prefill over the bare engine's, summed), "
            f"where the saturated worker's throughput is {p.prefill_factor_saturated:.3f} + "
            f"{p.prefill_stream_factor_saturated * 100:.4f}; by gap, every window: "
            + ", ".join(f"{g:g} s {f:.3f}" for g in LONE_GAPS
                        if (f := prefill_latency_factor(
                            [r for r in p.lone_prefill if r["gap"] == g],
                            engine_cost.engine_prompt)) is not None))
    beside = [f"{f:.3f} {k}" for f, k in ((p.serving_factor_idle, "idle"),
                                          (p.serving_factor_decoding,
                                           "beside a decoding worker")) if f is not None]
    idle = f" ({', '.join(beside)})" if beside else ""
    say(f"serving factors: decode {p.serving_factor:.3f}{idle}, prefill {p.prefill_factor:.3f} "
        f"+ {p.prefill_stream_factor * 100:.4f} per 100 tokens a second streamed meanwhile "
        "(a serving worker's time over the bare engine's)")
    if p.served_many:
        each = ", ".join(f"{c} {statistics.median(v):+.4f}" for c, v in slopes.items() if v)
        say(f"the decode factor's rise per stream past {STREAM_SLOPE_ABOVE}: "
            f"{p.serving_stream_slope:.4f} beside a busy or a decoding worker (medians: {each})")


def stream_slopes(p: Profile) -> dict[str, list[float]]:
    """Per condition (idle, busy, decoding), each :data:`SERVED_MANY` row's rise over that
    condition's factor per stream past :data:`STREAM_SLOPE_ABOVE` (the rows need ``model_s``)."""
    factors = p.factors_beside()
    out: dict[str, list[float]] = {c: [] for c in factors}
    for r in p.served_many:
        base = factors.get(r["beside"])
        if base is not None and r["batch"] > STREAM_SLOPE_ABOVE:
            out[r["beside"]].append((r["s"] / r["model_s"] - base)
                                    / (r["batch"] - STREAM_SLOPE_ABOVE))
    return out


def cmd_profile(a) -> int:
    cores = ([int(c) for c in a.cores.split(",")] if a.cores
             else sorted(os.sched_getaffinity(0)))
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[baton profile {time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr,
              flush=True)

    try:
        device = resolve_device(a.device)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.tensor_parallel_size < 1:
        print("error: --tensor-parallel-size must be >= 1", file=sys.stderr)
        return 2
    if a.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    if a.repeats < 1:
        print("error: --repeats must be >= 1", file=sys.stderr)
        return 2
    if a.threads > 1 and a.tensor_parallel_size > 1:
        print("error: --threads with --tensor-parallel-size: a worker of several ranks runs "
              "one torch thread a rank; measure one or the other", file=sys.stderr)
        return 2
    from baton.engine.config import device_kind

    if a.threads > 1 and device_kind(device) != "cpu":
        print(f"error: --threads {a.threads}: torch threads set a worker's pace on a CPU "
              f"only, and this profile would run on {device}", file=sys.stderr)
        return 2
    if not a.check and 2 * a.threads > len(cores):
        say(f"--threads {a.threads} on {len(cores)} core(s): the two measured workers (and "
            "the engine and its neighbour) share cores, so they measure slower than two "
            f"workers of {a.threads} threads on cores of their own")
    if a.refit and (a.check or a.serving):
        print("error: --refit measures nothing and --check measures: one or the other",
              file=sys.stderr)
        return 2
    if a.serving and not a.check:
        print("error: --serving checks a profile: pass --check PROFILE", file=sys.stderr)
        return 2
    if a.check and a.out and not a.serving:
        print("error: --check --out writes the profile scaled by the serving factors measured "
              "now: pass --serving too", file=sys.stderr)
        return 2
    if a.refit:
        return _refit(a.refit, a.out, say)
    from baton.bench.common import sigterm_as_ctrl_c

    # stopped (Ctrl-C, or SIGTERM as `kill` and `timeout` send it): the running part's own
    # cleanup stops what it started (the neighbour, the serving cluster, Redis), nothing written
    try:
        with sigterm_as_ctrl_c():
            return _measure(a, cores, device, say)
    except KeyboardInterrupt:
        say("stopped: nothing written")
        return 130


def _measure(a, cores: list[int], device: str, say: Callable[[str], None]) -> int:
    """`baton profile`'s measuring forms: ``--check`` (and ``--serving``), or a profile."""
    if a.check:
        try:
            p = Profile.load(a.check)
        except ProfileError as e:  # unreadable, another version, malformed
            print(f"error: --check {a.check}: {e}", file=sys.stderr)
            return 2
        if p.device.split(":")[0] != device.split(":")[0]:
            print(f"error: --check {a.check}: the profile was measured on {p.device}, this "
                  f"check would run on {device} (pass --device {p.device})", file=sys.stderr)
            return 2
        if a.serving and not (p.served and p.served_prefill):
            print(f"error: --check {a.check} --serving: the profile has no serving "
                  "measurements (measured with --no-handoff)", file=sys.stderr)
            return 2
        out = speed_probe(p, cores, max(a.repeats, 3), say)
        if a.serving:
            out["serving"] = serving_probe(p, cores, say)
        print(json.dumps(out))
        if a.out:
            from baton.control.calibrate import checked

            s = out["serving"]
            path = checked(p, s, str(a.check)).save(a.out)
            say(f"wrote {path}: {a.check} with its decode factors x{s['decode_ratio']:.3f} and "
                f"its prefill factors x{s['prefill_ratio']:.3f}, as the serving check found "
                "this machine")
        return 0
    p = run_profile(a.model, a.dtype, cores, a.repeats, not a.no_handoff, say,
                    not a.idle_neighbors, device, a.tensor_parallel_size, a.threads)
    path = p.save(a.out or default_path())
    cm = CostModel(p)
    for k, v in cm.summary().items():
        print(f"  {k}: {v:.4g}")
    print(f"wrote {path}")
    if (gap := p.table_vs_grid()) is not None:
        say(f"warning: {gap}")
    return 0


def _refit(src: str, out: str | None, say: Callable[[str], None]) -> int:
    """``--refit``: ``src``'s cost model and serving factors fitted again from its rows by this
    Baton's rules, written to ``out`` as this version's profile; nothing measured."""
    if not out:
        print("error: --refit writes a new profile: pass --out", file=sys.stderr)
        return 2
    try:
        p = Profile.load(src)
    except ProfileError as e:
        print(f"error: --refit {src}: {e}", file=sys.stderr)
        return 2
    if p.checked:
        print(f"error: --refit {src}: its factors were scaled by a serving check (its "
              "`checked`); refit the profile it checked, then check that again", file=sys.stderr)
        return 2
    if not p.served:
        print(f"error: --refit {src}: the profile has no serving measurements (measured "
              "with --no-handoff): nothing to fit the factors on", file=sys.stderr)
        return 2
    was = CostModel(p).summary()
    p.version = VERSION
    _serving_factors(p, say)
    now = CostModel(p).summary()
    for k, v in now.items():
        print(f"  {k}: {was.get(k, 0.0):.4g} -> {v:.4g}")
    print(f"wrote {p.save(out)}: {src}'s measurements fitted as a version-{VERSION} profile")
    if (gap := p.table_vs_grid()) is not None:  # a refit does not mend measurements
        say(f"warning: {gap}")
    return 0


def add_profile_args(ap) -> None:
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default=os.environ.get("BATON_DEVICE", "auto"),
                    help="where to measure, as the workers' --device: cpu, cuda, cuda:N, or "
                         "auto (cuda when a GPU is visible, else cpu; default $BATON_DEVICE, "
                         "else auto). The profile records it; `baton tune --live` refuses a "
                         "profile from another kind of device than its workers'")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="measure a worker of N ranks (`baton worker --tensor-parallel-size "
                         "N`), for `baton tune --tp-profile` (default 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads a worker, as the workers' --threads (`baton up` gives "
                         "each worker this machine's cores shared out): the engine, and each "
                         "measured worker, runs that many on as many cores of its own "
                         "(default 1). `baton tune --live` refuses a profile of another "
                         "thread count than its CPU workers'")
    ap.add_argument("--cores", default=None,
                    help="comma-separated cores: the engine runs on the first (--threads of "
                         "them), the hand-off's prefill and decode workers on the first and "
                         "the next (default: this process's)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed repeats per point (median); 1 also times the served grid once, "
                         "not twice (a quick, rough profile)")
    ap.add_argument("--idle-neighbors", action="store_true",
                    help="measure with the other cores idle (default: a busy engine runs on them, "
                         "as the cluster's other workers would near its goodput)")
    ap.add_argument("--no-handoff", action="store_true",
                    help="skip the worker measurements (hand-off and serving factor: no worker "
                         "processes, no NIXL; the factor stays 1)")
    ap.add_argument("--check", metavar="PROFILE", default=None,
                    help="write no profile: time PROFILE's largest prefill step and a decode "
                         "step again on --cores and print this machine's speed against the day "
                         "it was measured (ratios above 1: slower now; re-profile when they "
                         "are far from 1, as a shared VM's can be within the hour)")
    ap.add_argument("--refit", metavar="PROFILE", default=None,
                    help="measure nothing: fit PROFILE's cost model and serving factors again "
                         "from its measurements by this Baton's rules and write them to --out "
                         "as a profile of this version (an older profile's factors were fitted "
                         "over an older model; seconds where measuring again takes 20 minutes)")
    ap.add_argument("--serving", action="store_true",
                    help="with --check: also start real workers and measure the serving factors "
                         "(the served decode grid once with the prefill worker busy and once "
                         "beside a decoding worker, one window of the prefill worker "
                         "saturated, and for a version-10 profile lone prompts with nothing "
                         "streamed and with 16 other streams, whose line then scales the "
                         "prefill factor and its rise with streaming) against the profile's; "
                         "they can move while the bare engine's speed holds (~5 min in all on a "
                         "2-vCPU VM)")
    ap.add_argument("--out", default=None,
                    help="profile file (default $BATON_CACHE_DIR/profile.json, else "
                         "~/.cache/baton/profile.json); with --check PROFILE --serving: write "
                         "PROFILE there with its serving factors scaled as the check found "
                         "this machine (~5 minutes where measuring again takes 20; the check is "
                         "kept in its `checked`)")
