"""Calls to a router's gRPC API as tests make them."""

from __future__ import annotations

from baton_client.v1 import api_pb2, api_pb2_grpc


def generate_ids(router, ids: list[int], max_tokens: int, timeout: float = 60.0,
                 salt: str | None = None):
    """(token ids, final message) of one streamed greedy Generate of prompt ``ids`` (a plain
    stub on the router's channel, ``ignore_eos``; ``salt``: its cache salt)."""
    params = api_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if salt is not None:
        params.cache_salt = salt
    req = api_pb2.GenerateRequest(params=params)
    req.token_ids.ids.extend(ids)
    out, final = [], None
    for msg in api_pb2_grpc.BatonStub(router.channel).Generate(req, timeout=timeout):
        if msg.HasField("delta"):
            out += msg.delta.token_ids
        else:
            final = msg.final
    return out, final
