"""The worker API's conversions and metadata keys, shared by the router and the workers:
sampling parameters to and from ``baton.v1.SamplingParams``, log-probabilities, and the trailing
metadata a worker names a rejected field or a failed peer in. Torch-free."""

from __future__ import annotations

from baton.engine.errors import InvalidRequestError
from baton.engine.params import SamplingParams
from baton_client.v1 import api_pb2

FIELD_METADATA = "baton-field"


# a decode worker's failed hand-off: the address of the prefill worker (the holder) it failed
# on, so the router retries without that worker rather than without this one
PEER_METADATA = "baton-failed-peer"


def params_from_proto(m) -> SamplingParams:
    """The engine's parameters; ``max_tokens`` must be set (the router resolves each API's
    default before any worker call)."""
    if not m.HasField("max_tokens"):
        raise InvalidRequestError("params.max_tokens", None,
                                  "required on the worker API (the router sets it)")
    return SamplingParams(
        max_tokens=m.max_tokens,
        temperature=m.temperature, top_k=m.top_k,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        seed=m.seed if m.HasField("seed") else None, stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        cache_salt=m.cache_salt if m.HasField("cache_salt") else None,
        logprobs=m.logprobs if m.HasField("logprobs") else None, fit_pool=m.fit_pool,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=(m.repetition_penalty if m.HasField("repetition_penalty")
                            else 1.0),
        logit_bias=tuple(sorted(m.logit_bias.items())), min_p=m.min_p,
        min_tokens=m.min_tokens, output_prefix=m.output_prefix, grammar=m.grammar)


def params_to_proto(p: SamplingParams):
    return api_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        seed=p.seed, stop=p.stop, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        cache_salt=p.cache_salt, logprobs=p.logprobs, fit_pool=p.fit_pool,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias), min_p=p.min_p,
        min_tokens=p.min_tokens, output_prefix=p.output_prefix, grammar=p.grammar)


def logprob_to_proto(lp):
    """baton.engine.sampler.TokenLogprobs -> baton.v1.TokenLogprob."""
    return api_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[api_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
