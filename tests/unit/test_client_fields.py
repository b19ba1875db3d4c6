"""The SDK (baton_client) carries every field of the final message into ``Result``, sends
per-call metadata and refuses a timeout it cannot honour: against a plain gRPC server on
loopback that answers with every GenerateFinal field set and echoes the metadata it received."""

from __future__ import annotations

import asyncio
import math
from concurrent import futures

import grpc
import pytest
from baton_client import AsyncClient, Client
from baton_client.v1 import api_pb2, api_pb2_grpc

# every GenerateFinal field, by name, to the Result attribute that carries it (last_delta is
# folded into text / token_ids, as any delta is)
FOLDED = {"last_delta"}


def _full_final(echo: str) -> api_pb2.GenerateFinal:
    """A final message with every field set to a value no default has."""
    return api_pb2.GenerateFinal(
        finish_reason="stop", path="migrated", prefill_worker="prefill-7",
        decode_worker="decode-9", transports="tcp", retries=2, prompt_token_ids=[4, 5],
        route_reason="many-new-tokens", index_cached_tokens=32, index_used=True,
        kv_blocks_read=3, kv_blocks_local=1, migrations=1, migrated_from=["decode-2"],
        last_delta=api_pb2.GenerateDelta(text="!", token_ids=[9]), request_id="mine",
        router_request_id=echo, tool_calls=[api_pb2.ToolCall(id="c1", name="f",
                                                            arguments="{}")],
        content="outside", reasoning_content="thought",
        usage=api_pb2.Usage(prompt_tokens=2, cached_tokens=1, completion_tokens=2,
                            cached_tokens_host=1, cached_tokens_disk=0),
        timing=api_pb2.Timing(**{f.name: 0.5 + i for i, f in
                                 enumerate(api_pb2.Timing.DESCRIPTOR.fields)}))


class Echo(api_pb2_grpc.BatonServicer):
    """Streams one delta and a full final; router_request_id carries the call's metadata."""

    def Generate(self, request, context):
        got = sorted((k, v) for k, v in context.invocation_metadata()
                     if k.startswith("x-") and not k.endswith("-bin"))
        yield api_pb2.GenerateResponse(delta=api_pb2.GenerateDelta(text="hi", token_ids=[8]))
        yield api_pb2.GenerateResponse(final=_full_final(repr(got)))

    def ListModels(self, request, context):
        meta = dict(context.invocation_metadata())
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelCard(id=meta.get("x-team", ""))])


@pytest.fixture(scope="module")
def echo():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    api_pb2_grpc.add_BatonServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_every_final_field_reaches_the_result(echo):
    with Client(echo) as c:
        r = c.generate("x", metadata=[("x-team", "search"), ("x-trace", "42")])
    final = _full_final(r.router_request_id)
    for f in api_pb2.GenerateFinal.DESCRIPTOR.fields:
        if f.name in FOLDED:
            continue
        assert hasattr(r, f.name), f"Result drops GenerateFinal.{f.name}"
        got, sent = getattr(r, f.name), getattr(final, f.name)
        if f.message_type is None:
            assert (list(got) if f.is_repeated else got) == \
                (list(sent) if f.is_repeated else sent), f.name
            continue
        for sub in f.message_type.fields:  # usage, timing, tool_calls: every sub-field
            items = zip(got, sent) if f.is_repeated else [(got, sent)]
            for g, s in items:
                assert math.isclose(getattr(g, sub.name), getattr(s, sub.name)) \
                    if sub.type == sub.TYPE_DOUBLE else getattr(g, sub.name) == \
                    getattr(s, sub.name), f"{f.name}.{sub.name}"
    assert r.text == "hi!" and r.token_ids == [8, 9]  # the delta and the final's last delta
    assert r.migrated_from == ["decode-2"] and r.transports == "tcp"


def test_per_call_metadata_is_sent_sync_and_async(echo):
    with Client(echo) as c:
        r = c.generate("x", metadata=[("x-team", "search")])
        assert r.router_request_id == repr([("x-team", "search")])
        assert c.generate("x").router_request_id == "[]"  # per call: not kept
        assert c.models(metadata=[("x-team", "ads")])[0].id == "ads"
        s = c.stream("x", metadata=(("x-a", "1"), ("x-b", "2")))
        list(s)
        assert s.result.router_request_id == repr([("x-a", "1"), ("x-b", "2")])

    async def run():
        async with AsyncClient(echo) as ac:
            r = await ac.generate("x", metadata=[("x-team", "async")])
            return r.router_request_id, (await ac.models(metadata=[("x-team", "m")]))[0].id

    assert asyncio.run(run()) == (repr([("x-team", "async")]), "m")


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.nan, math.inf, "5", True])
def test_a_timeout_that_cannot_be_honoured_is_refused(echo, bad):
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        Client(echo, timeout=bad)
    with Client(echo) as c:
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            c.generate("x", timeout=bad)
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            c.models(timeout=bad)
        assert c.generate("x", timeout=None).text == "hi!"  # None: the client's default
        assert c.generate("x", timeout=2).text == "hi!"


@pytest.mark.parametrize("meta, named", [
    ([("X-Upper", "v")], "X-Upper"), ([("grpc-timeout", "1")], "grpc-timeout"),
    ([("authorization", "Bearer t")], "authorization"), ([("x-bin", "text")], "x-bin"),
    ([("x-n", 3)], "x-n"), ([("", "v")], "''")])
def test_bad_metadata_is_refused_naming_the_key(echo, meta, named):
    with Client(echo) as c, pytest.raises(ValueError, match=named):
        c.generate("x", metadata=meta)
