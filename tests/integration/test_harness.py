"""The test suite's one cluster fixture (tests/support/cluster.py): any shape starts, and a start
that fails leaves no process behind."""

from __future__ import annotations

import os

import pytest
from baton.services.launch.local import WorkerStartError
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.support.cluster import Cluster

pytestmark = pytest.mark.slow


def children() -> set[int]:
    """Live (not zombie) child processes of this test process."""
    me, kids = os.getpid(), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            kids.add(int(pid))
    return kids


def test_a_failed_start_stops_what_had_started(tiny_llama):
    before = children()
    # the prefill worker and Redis start; the decode worker refuses its flag and exits
    with pytest.raises(WorkerStartError, match="no-such-flag"):
        Cluster(prefill=1, decode=1, worker_args=["--model", str(tiny_llama[0])],
                role_args={"decode": ["--no-such-flag"]})
    assert children() == before


def test_any_shape_serves_and_stops(tiny_llama):
    before = children()
    with Cluster(prefill=2, decode=2, routers=[[], []],
                 worker_args=["--model", str(tiny_llama[0]), "--num-blocks", "32"]) as c:
        assert (len(c.prefill), len(c.decode), len(c.routers)) == (2, 2, 2)
        assert len(children() - before) == 1 + 4 + 2  # redis-server, workers, routers
        for r in c.routers:
            msgs = list(api_pb2_grpc.BatonStub(r.channel).Generate(api_pb2.GenerateRequest(
                text="hi", params=api_pb2.SamplingParams(max_tokens=2)), timeout=60))
            assert msgs[-1].final.finish_reason
        c.assert_quiet()
    assert children() == before
