"""KV hand-off between real processes over real NIXL (UCX, DRAM): a prefill worker prefills
SmolLM2 prompts, a decode worker pulls the blocks and decodes. Faults: lease expiry during a
read, a killed / stalled / restarted prefill worker, mismatched peers, bad handles."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from baton.engine.engine import LLMEngine
from baton.engine.params import SamplingParams
from baton.services.common.protocol import params_to_proto
from baton.services.launch.local import WorkerProcess, WorkerStartError
from baton.v1 import worker_pb2, worker_pb2_grpc

from tests.support.pair import Pair, eventually, start_pair
from tests.support.processes import free_port
from tests.support.reference import REFERENCE_POOL

pytestmark = pytest.mark.slow

PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about the sea."),
    ("chat", "日本の首都はどこですか？"),
    ("chat", "Explain paged attention to a new engineer, with an example."),
    ("text", "The capital of France is"),
    ("text", "def fibonacci(n):\n    "),
    ("text", "Once upon a time, in a village by the river,"),
    ("text", "1, 1, 2, 3, 5, 8,"),
    ("text", " ".join(f"Item {i}: the {w} report." for i, w in
                      enumerate(["first", "second", "third", "fourth"] * 30))),  # ~380 tokens
    ("text", "Ünïcödé: ça marche très bien, naïve café —"),
    ("chat", "Summarise: " + "The decode worker pulls KV blocks over NIXL. " * 40),
]


@pytest.fixture(scope="module")
def reference():
    return LLMEngine.from_path(None, REFERENCE_POOL)


@pytest.fixture(scope="module")
def pair():
    p = start_pair()
    yield p
    p.stop()


def encode(engine, kind, text):
    if kind == "chat":
        return engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    return engine.tokenizer.encode(text)


def test_disaggregated_tokens_equal_colocated(pair, reference):
    params = SamplingParams(max_tokens=24)
    prompts = [encode(reference, k, t) for k, t in PROMPTS]
    expected = [c.token_ids for c in reference.generate(prompts, params)]
    got: dict[int, list[int]] = {}

    def run(i):  # three at a time: the workers batch them, the pulls overlap
        got[i] = pair.handoff(prompts[i], params, f"eq-{i}")[0]

    for start in range(0, len(prompts), 3):
        threads = [threading.Thread(target=run, args=(i,))
                   for i in range(start, min(start + 3, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i in range(len(prompts)):
        assert got[i] == expected[i], (PROMPTS[i], got[i], expected[i])
    # seeded sampling continues from the prefill's generator state: the same tokens as colocated
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    for i in (0, 5):
        assert pair.handoff(prompts[i], seeded, f"seeded-{i}")[0] == \
            reference.generate([prompts[i]], seeded)[0].token_ids
    _, stats = pair.handoff(prompts[8], params, "stats")
    assert stats.blocks_read + stats.blocks_local == -(-len(prompts[8]) // 16)
    assert stats.bytes == stats.blocks_read * 30 * 2 * 16 * 3 * 64 * 4
    info = pair.decode.info()
    # DRAM pools (CPU workers): cma, or tcp; VRAM pools (BATON_DEVICE=cuda): cuda_ipc
    ways = ("cuda_ipc",) if info.kv_memory == "VRAM" else ("cma", "tcp")
    assert any(w in stats.transports for w in ways), (info.kv_memory, stats)
    assert info.transports == stats.transports and info.known_peers == 1
    pair.assert_idle_and_intact()


def test_cli_handoff(pair, reference):
    r = subprocess.run([sys.executable, "-m", "baton.cli.main", "handoff", "--json", "--chat",
                        "--max-tokens", "12", "--prefill", pair.prefill.address, "--decode",
                        pair.decode.address, "Write a haiku about the sea."],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ids = encode(reference, "chat", "Write a haiku about the sea.")
    expected = reference.generate([ids], SamplingParams(max_tokens=12))[0]
    assert out["prompt_token_ids"] == ids and out["token_ids"] == expected.token_ids
    assert out["text"] == expected.text
    assert out["transfer"]["bytes"] > 0 and out["transfer"]["transports"]
    r = subprocess.run([sys.executable, "-m", "baton.cli.main", "handoff", "hi", "--prefill",
                        "127.0.0.1:1", "--decode", pair.decode.address, "--timeout", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


def test_bad_handles_get_typed_errors_and_the_workers_keep_serving(pair, reference):
    params = SamplingParams(max_tokens=4)
    ids = encode(reference, "text", "The capital of France is")
    pre = pair.prefill_call(ids, params, "bad-0")
    forged = worker_pb2.PrefillResponse()
    forged.CopyFrom(pre)
    forged.handle.lease_id = "0" * 24
    with pytest.raises(grpc.RpcError) as e:
        pair.decode_call(ids, params, "bad-1", forged)
    assert e.value.code() == grpc.StatusCode.ABORTED and "unknown lease" in e.value.details()
    forged.handle.fingerprint = "not-this-model"
    with pytest.raises(grpc.RpcError) as e:
        pair.decode_call(ids, params, "bad-2", forged)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
        pair.decode_call(ids[:-1], params, "bad-3", pre)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_tokens" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        pair.prefill_call([], params, "bad-4")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    tokens, _ = pair.decode_call(ids, params, "bad-0", pre)  # the real handle still works
    assert tokens == reference.generate([ids], params)[0].token_ids
    pair.assert_idle_and_intact()


def test_lease_expiry_during_the_read_is_detected_and_nothing_is_decoded(reference):
    # The decode worker holds the read 2.5 s before releasing; the lease lasts 1 s. Meanwhile
    # another prompt is prefilled into the freed blocks, so the read really went stale.
    p = start_pair(["--lease-ttl", "1.0", "--num-blocks", "8"], ["--faults", "delay_release=2.5"])
    try:
        params = SamplingParams(max_tokens=8)
        ids = encode(reference, "text", "A" + " tale of two cities" * 12)  # 4 blocks
        other = encode(reference, "text", "B" + " different words entirely" * 12)
        pre = p.prefill_call(ids, params, "stale")
        errors = []

        def decode():
            try:
                p.decode_call(ids, params, "stale", pre)
            except grpc.RpcError as e:
                errors.append(e)

        t = threading.Thread(target=decode)
        t.start()
        time.sleep(1.3)  # the lease expired and its blocks were freed
        p.prefill_call(other, SamplingParams(max_tokens=1), "overwrite")  # reuses them
        t.join()
        assert len(errors) == 1, "decoded from an expired lease"
        assert errors[0].code() == grpc.StatusCode.ABORTED
        assert "not intact" in errors[0].details() and "expired" in errors[0].details()
        assert p.prefill.info().leases_expired >= 1
        p.assert_idle_and_intact()
        # the holder killed mid-hand-off (read done, release pending): the release fails typed
        pre = p.prefill_call(ids, params, "orphan")
        t = threading.Thread(target=decode)
        t.start()
        time.sleep(0.8)
        p.prefill.kill()
        t.join()
        # UNAVAILABLE (the holder is gone), not DEADLINE_EXCEEDED: the release failed as soon as
        # it was tried, it did not wait out the hand-off's deadline
        assert len(errors) == 2 and errors[1].code() == grpc.StatusCode.UNAVAILABLE
        info = eventually(lambda: p.decode.info(check_integrity=True),
                           lambda i: i.num_free_blocks == i.num_blocks)
        assert info.integrity_ok and info.num_free_blocks == info.num_blocks
    finally:
        p.stop()


def _thread_states(pid: int) -> str:
    """The /proc state letter of each of a process's threads (R running, S sleeping, T stopped,
    ...), e.g. "TTTS"."""
    out = ""
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            out += (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    return out


def test_killed_stalled_and_restarted_prefill_worker(reference, tmp_path):
    port = free_port()
    prefill_args = ["--port", str(port), "--num-blocks", "64"]
    prefill = WorkerProcess("prefill", prefill_args)
    decode = WorkerProcess("decode", ["--num-blocks", "64", "--peers", prefill.address,
                                      "--transfer-timeout", "3"])
    p = Pair(prefill, decode)
    params = SamplingParams(max_tokens=8)
    ids = encode(reference, "text", "The capital of France is")
    expected = reference.generate([ids], params)[0].token_ids
    try:
        assert p.handoff(ids, params, "before")[0] == expected
        # stalled: SIGSTOP after the prefill; the decode side fails within its 3 s deadline
        pre = p.prefill_call(ids, params, "stalled")
        os.kill(prefill.pid, signal.SIGSTOP)
        # kill() returns before every thread has stopped: a thread still running could answer
        # the hand-off (seen three times in full `.ci/run`s, state R right after the kill), so
        # the call starts only once each thread reads T
        states = [eventually(lambda: _thread_states(prefill.pid),
                             lambda s: s and set(s) <= {"T", "t"})]
        try:
            got = p.decode_call(ids, params, "stalled", pre)
        except grpc.RpcError as err:
            error = err
        else:
            after = _thread_states(prefill.pid)
            pytest.fail(f"a hand-off from a SIGSTOPped prefill worker succeeded ({got}); its "
                        f"threads' states before and after: {states + [after]}")
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        # the worker's own 3 s --transfer-timeout ended it (the call's deadline is 120 s)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.details()
        assert error.details().startswith("TransferDeadlineError"), error.details()
        # killed between prefill and read: a typed error at once, not at the deadline
        pre = p.prefill_call(ids, params, "killed")
        prefill.kill()
        with pytest.raises(grpc.RpcError) as e:
            p.decode_call(ids, params, "killed", pre)
        # UNAVAILABLE, not DEADLINE_EXCEEDED: it did not wait for the 3 s deadline
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        # restarted on the same address: a new incarnation, picked up without touching decode
        p.prefill = prefill = WorkerProcess("prefill", prefill_args)
        assert prefill.incarnation != pre.handle.incarnation
        assert p.handoff(ids, params, "after")[0] == expected
        with pytest.raises(grpc.RpcError) as e:  # a handle from the dead incarnation
            p.decode_call(ids, params, "stale-incarnation", pre)
        assert e.value.code() == grpc.StatusCode.ABORTED and "restarted" in e.value.details()
        assert decode.proc.poll() is None
        p.assert_idle_and_intact()
    finally:
        p.stop()


def test_mismatched_peers_refuse_each_other(pair, reference):
    # another model fingerprint (block size); another KV dtype, named as such (both ends')
    with pytest.raises(WorkerStartError, match="fingerprint"):
        WorkerProcess("decode", ["--num-blocks", "64", "--block-size", "8",
                                 "--peers", pair.prefill.address])
    with pytest.raises(WorkerStartError, match="KV cache dtype mismatch.*float32.*bfloat16"):
        WorkerProcess("decode", ["--num-blocks", "64", "--dtype", "bfloat16",
                                 "--peers", pair.prefill.address])
    other = WorkerProcess("decode", ["--num-blocks", "64", "--dtype", "bfloat16"])
    try:
        params = SamplingParams(max_tokens=4)
        ids = encode(reference, "text", "The capital of France is")
        pre = pair.prefill_call(ids, params, "mismatch")
        stub = worker_pb2_grpc.DecodeWorkerStub(other.channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(worker_pb2.DecodeRequest(
                request_id="mismatch", prompt_token_ids=ids, first_token_id=pre.first_token_id,
                params=params_to_proto(params), handle=pre.handle), timeout=30))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "KV cache dtype mismatch" in e.value.details()
        info = other.info(check_integrity=True)
        assert info.integrity_ok and info.num_free_blocks == info.num_blocks
    finally:
        other.stop()
    # the unread lease expires or is released by the reader's give-back; either way it ends
    eventually(lambda: pair.prefill.info(), lambda i: i.active_leases == 0, timeout=35)


def test_checksummed_handoff(reference):
    p = start_pair(["--kv-checksums"])
    try:
        params = SamplingParams(max_tokens=8)
        ids = encode(reference, "chat", "Write a haiku about the sea.")
        pre = p.prefill_call(ids, params, "crc")
        assert len(pre.handle.block_crc32) == len(pre.handle.block_ids) > 0
        tokens, _ = p.decode_call(ids, params, "crc", pre)
        assert tokens == reference.generate([ids], params)[0].token_ids
    finally:
        p.stop()


SOAK_HANDOFFS = int(os.environ.get("BATON_SOAK_HANDOFFS", "2000"))


def test_soak_consecutive_handoffs_leak_nothing(tiny_llama):
    """2,000 consecutive hand-offs between two processes. A tiny random model keeps the forward
    passes short; the transfer path (handshake, lease, NIXL READ, release) is the real one."""
    path, _ = tiny_llama
    args = ["--model", str(path), "--block-size", "4", "--num-blocks", "64", "--threads", "1"]
    p = start_pair(args, args)
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)

        def run(n, offset):
            for i in range(n):
                ids = [(7 * (i + offset) + j) % 300 + 4 for j in range(5 + (i + offset) % 23)]
                tokens, stats = p.handoff(ids, params, f"soak-{offset + i}")
                assert len(tokens) == 2 and stats.blocks_read + stats.blocks_local >= 2

        def usage():
            return [(w.info().rss_bytes, w.info().open_fds) for w in (p.prefill, p.decode)]

        run(200, 0)  # warm-up: allocator pools, gRPC and UCX caches fill to their steady size
        before = usage()
        t0 = time.monotonic()
        run(SOAK_HANDOFFS, 200)
        elapsed = time.monotonic() - t0
        after = usage()
        for role, (rss0, fd0), (rss1, fd1) in zip(("prefill", "decode"), before, after):
            print(f"soak {role}: {SOAK_HANDOFFS} hand-offs in {elapsed:.1f}s, "
                  f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
                  f"({(rss1 - rss0) / 2**20:+.1f}), fds {fd0} -> {fd1}")
            assert fd1 - fd0 <= 2, (role, fd0, fd1)
            assert rss1 - rss0 < 16 * 2**20, (role, rss0, rss1)
        assert p.prefill.info().leases_granted >= SOAK_HANDOFFS + 200
        p.assert_idle_and_intact()
    finally:
        p.stop()
