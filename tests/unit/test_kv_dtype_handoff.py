"""A bf16 KV pool and an FP8 one refuse each other's blocks: the holder refuses the reader's
handshake (FAILED_PRECONDITION naming both element types) and the reader raises a typed error
that says the same. Real NIXL agents and a real gRPC KVSource in this process; the same
fingerprint on both sides, so the refusal is the dtype check's own (the engines' fingerprints
differ too: an FP8 cache is in them)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from baton.services.common.process import make_server
from baton.transfer.agent import KVAgent, configure_ucx
from baton.transfer.errors import FingerprintMismatchError
from baton.transfer.holder import KVHolder
from baton.transfer.lease import LeaseTable
from baton.transfer.reader import KVReader
from baton.v1 import worker_pb2, worker_pb2_grpc

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def pool(dtype: torch.dtype) -> torch.Tensor:
    """8 blocks of 64 bytes in ``dtype``: the two dtypes' blocks are the same size."""
    return torch.zeros(8, 4, 16 // dtype.itemsize, dtype=dtype)


@pytest.fixture(params=[(BF16, FP8), (FP8, BF16)], ids=["bf16-holder", "fp8-holder"])
def pair(request):
    """(holder, reader agent) with the KV dtypes of the param, one fingerprint."""
    configure_ucx()
    held, read = request.param
    agent = KVAgent(f"holder-{held.itemsize}", pool(held))
    server = make_server(max_workers=4)
    port = server.add_insecure_port("127.0.0.1:0")
    h = KVHolder(worker_id="h", incarnation="inc1", address=f"127.0.0.1:{port}",
                 fingerprint="fp", agent=agent, leases=LeaseTable(ttl_s=60), free=lambda r: None)
    worker_pb2_grpc.add_KVSourceServicer_to_server(h, server)
    server.start()
    reader_agent = KVAgent(f"reader-{read.itemsize}", pool(read))
    yield h, reader_agent
    reader_agent.close()
    server.stop(None)
    agent.close()


def names_both(text: str) -> bool:
    return "bfloat16" in text and "float8_e4m3fn" in text


def test_a_reader_of_another_kv_dtype_is_refused_naming_both(pair):
    holder, agent = pair
    reader = KVReader(agent, "fp", "r")
    try:
        with pytest.raises(FingerprintMismatchError) as err:
            reader.connect(holder.address, time.monotonic() + 30)
        assert names_both(str(err.value)) and "--kv-cache-dtype" in str(err.value)
        assert reader.num_peers == 0
    finally:
        reader.close()


def test_a_plain_stub_gets_failed_precondition_naming_both(pair):
    # a generated stub with no deadline, as any client would call it
    holder, agent = pair
    other = str(agent.kv.dtype).removeprefix("torch.")
    with grpc.insecure_channel(holder.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.KVSourceStub(ch).Handshake(
                worker_pb2.HandshakeRequest(fingerprint="fp", reader_id="x", kv_dtype=other))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert names_both(err.value.details())
        # the holder's own dtype is taken (and said in the answer)
        mine = str(holder.agent.kv.dtype).removeprefix("torch.")
        resp = worker_pb2_grpc.KVSourceStub(ch).Handshake(
            worker_pb2.HandshakeRequest(fingerprint="fp", reader_id="x", kv_dtype=mine))
        assert resp.kv_dtype == mine


def test_a_handle_of_another_kv_dtype_is_refused_before_any_read(pair):
    # the handle says the holder's dtype: the reader refuses it before the handshake
    holder, agent = pair
    reader = KVReader(agent, "fp", "r")
    try:
        handle = holder.grant("req", (1, 2), 8)
        assert handle.kv_dtype == str(holder.agent.kv.dtype).removeprefix("torch.")
        with pytest.raises(FingerprintMismatchError) as err:
            reader.pull(handle, (3, 4), 0, time.monotonic() + 30)
        assert names_both(str(err.value)) and reader.num_peers == 0
    finally:
        reader.close()
