"""Access in the default configuration of `baton up` (tiny model): every socket of every process
(redis-server, workers, router; gRPC, metrics, lease channel, UCX) listens on loopback only;
API keys from --auth-token and --api-keys-file are required on both public APIs; and a key's
--max-concurrent-per-key cap refuses with RESOURCE_EXHAUSTED / HTTP 429, naming the limit."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from baton.v1 import worker_pb2
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.support.processes import descendants
from tests.support.up import own_cache

pytestmark = pytest.mark.slow


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, port = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(raw)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            out.append((str(addr), int(port, 16)))
    return out


def outside_address() -> str | None:
    """This machine's address on a non-loopback interface, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent; picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(ip).is_loopback else ip


def test_default_cluster_is_loopback_only_and_needs_a_key(tiny_llama, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# two teams\nteam-a-key\nteam-b-key\n")
    up = subprocess.Popen(
        [sys.executable, "-m", "baton.cli.main", "up", "--model", str(tiny_llama[0]),
         "--num-blocks", "64", "--grpc-port", "0", "--http-port", "0", "--log-dir",
         str(tmp_path), "--api-keys-file", str(keys),
         "--router-args", "--max-concurrent-per-key 1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **own_cache(tmp_path)})
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if "OpenAI-compatible API on" in line:
                break
        text = "".join(lines)
        grpc_addr = re.search(r"gRPC API \(baton.v1.Baton\) on (\S+:\d+);", text)
        http_addr = re.search(r"OpenAI-compatible API on https?://(\S+:\d+)", text)
        assert grpc_addr and http_addr, text
        grpc_addr, http_addr = grpc_addr.group(1), http_addr.group(1)
        threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True).start()

        # ---- loopback only ---------------------------------------------------------------
        procs = descendants(up.pid)
        socks = {p: listening(p) for p in procs}
        assert sum(map(len, socks.values())) >= 8, socks  # redis, 2 workers, router
        for pid, addrs in socks.items():
            for addr, port in addrs:
                assert ipaddress.ip_address(addr).is_loopback, (pid, addr, port)
        ip = outside_address()
        if ip is not None:  # nothing answers on the machine's own address
            for addrs in socks.values():
                for _, port in addrs:
                    with socket.socket() as s:
                        s.settimeout(1)
                        assert s.connect_ex((ip, port)) != 0, (ip, port)

        # ---- API keys on both APIs -----------------------------------------------------------
        stub = api_pb2_grpc.BatonStub(grpc.insecure_channel(grpc_addr))
        req = api_pb2.GenerateRequest(text="hello", params=api_pb2.SamplingParams(
            max_tokens=4))
        for md in ((), (("authorization", "Bearer wrong"),), (("authorization", "team-a-key"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=md, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for key in ("team-a-key", "team-b-key"):
            msgs = list(stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),),
                                      timeout=60))
            assert msgs[-1].final.finish_reason

        def post(key: str | None, body: dict) -> tuple[int, dict]:
            h = {"Content-Type": "application/json"}
            if key:
                h["Authorization"] = f"Bearer {key}"
            r = urllib.request.Request(f"http://{http_addr}/v1/completions", method="POST",
                                       data=json.dumps(body).encode(), headers=h)
            try:
                with urllib.request.urlopen(r, timeout=60) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as err:
                return err.code, json.loads(err.read())

        body = {"prompt": "hello", "max_tokens": 4}
        assert post(None, body)[0] == 401 and post("nope", body)[0] == 401
        assert post("team-b-key", body)[0] == 200

        # ---- one request at a time per key ---------------------------------------------------
        long = api_pb2.GenerateRequest(text="hello", params=api_pb2.SamplingParams(
            max_tokens=200, ignore_eos=True))
        a = stub.Generate(long, metadata=(("authorization", "Bearer team-a-key"),), timeout=60)
        next(a)  # team a's request runs
        status, err = post("team-a-key", body)
        assert status == 429 and "max_concurrent_per_key=1" in err["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, metadata=(("authorization", "Bearer team-a-key"),),
                               timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert post("team-b-key", body)[0] == 200  # another key is not held up
        assert list(a)[-1].final.usage.completion_tokens == 200
        assert post("team-a-key", body)[0] == 200  # its slot is free again
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(90)
    assert up.returncode == 0, "".join(lines[-30:])


def test_redis_auth_is_required_and_used(tiny_llama):
    from baton.control.redis_server import EmbeddedRedis
    from baton.services.launch.local import WorkerProcess, WorkerStartError

    r = EmbeddedRedis(password="s3cret-pw").start()
    workers = []
    try:
        open_url = r.url.replace(":s3cret-pw@", "")
        with pytest.raises(WorkerStartError, match="(?i)auth"):  # without the password: refused
            WorkerProcess("decode", ["--model", str(tiny_llama[0]), "--num-blocks", "32",
                                     "--redis-url", open_url], ready_timeout=60)
        env = {"BATON_REDIS_URL": r.url}  # the password stays off every command line
        workers.append(WorkerProcess("decode", ["--model", str(tiny_llama[0]), "--num-blocks",
                                                "32"], env=env))
        workers.append(WorkerProcess("router", ["--http-port", "-1"], env=env))
        msgs = list(api_pb2_grpc.BatonStub(workers[-1].channel).Generate(
            api_pb2.GenerateRequest(text="hi", params=api_pb2.SamplingParams(max_tokens=3)),
            timeout=60))
        assert msgs[-1].final.finish_reason
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "s3cret-pw" not in ps  # not on any command line, redis-server's included
    finally:
        for w in reversed(workers):
            w.stop()
        r.stop()


def test_baton_up_keeps_the_redis_password_and_the_api_key_off_every_command_line(
        tiny_llama, tmp_path):
    """`baton up` with a Redis password and an API key from its environment: the workers and
    the router get them in theirs, so `ps` shows neither on any command line (redis-server's
    included), and the cluster serves with them. The cluster secret it makes is in no command
    line either, and its workers refuse a handshake without it."""
    from baton.control.redis_server import EmbeddedRedis

    r = EmbeddedRedis(password="s3cret-up-pw").start()
    env = {**os.environ, **own_cache(tmp_path), "BATON_REDIS_URL": r.url,
           "BATON_AUTH_TOKEN": "s3cret-api-key"}
    up = subprocess.Popen(
        [sys.executable, "-m", "baton.cli.main", "up", "--model", str(tiny_llama[0]),
         "--num-blocks", "64", "--grpc-port", "0", "--http-port", "-1", "--log-dir",
         str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if "ready:" in line or "error" in line:
                break
        text = "".join(lines)
        addr = re.search(r"gRPC API \(baton.v1.Baton\) on (\S+:\d+);", text)
        assert addr, text
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "s3cret-up-pw" not in ps and "s3cret-api-key" not in ps
        with grpc.insecure_channel(addr.group(1)) as ch:
            stub = api_pb2_grpc.BatonStub(ch)
            req = api_pb2.GenerateRequest(text="hi",
                                          params=api_pb2.SamplingParams(max_tokens=3))
            with pytest.raises(grpc.RpcError) as e:  # the key is required
                list(stub.Generate(req, timeout=60))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            msgs = list(stub.Generate(req, timeout=60,
                                      metadata=[("authorization", "Bearer s3cret-api-key")]))
            assert msgs[-1].final.finish_reason
        # the cluster secret `baton up` made: in its processes' environment, in no argv, and
        # required by every worker
        from baton.control.registry import WorkerRegistry
        from baton.transfer.cluster_secret import ENV, METADATA_KEY

        workers = WorkerRegistry.from_url(r.url).workers()
        assert {w.role for w in workers} == {"prefill", "decode"}
        pids = [p for p in descendants(up.pid)
                if b"baton.services.prefill" in Path(f"/proc/{p}/cmdline").read_bytes()]
        environ = dict(kv.split(b"=", 1) for kv in
                       Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0") if b"=" in kv)
        secret = environ[ENV.encode()].decode()
        assert len(secret) >= 32 and secret not in ps
        prefill = next(w for w in workers if w.role == "prefill")
        with pytest.raises(grpc.RpcError) as e:
            handshake(prefill.address, (), prefill.fingerprint)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert handshake(prefill.address, ((METADATA_KEY, secret),),
                         prefill.fingerprint).agent_metadata
    finally:
        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=90)[0]
        r.stop()
    assert up.returncode == 0, rest
    assert "s3cret-up-pw" not in text + rest and "s3cret-api-key" not in text + rest
    assert secret not in text + rest


def handshake(address: str, metadata=(), fingerprint: str = "?"):
    from baton.v1 import worker_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.KVSourceStub(ch).Handshake(
            worker_pb2.HandshakeRequest(fingerprint=fingerprint, reader_id="intruder"),
            metadata=metadata, timeout=30)


def test_workers_with_a_cluster_secret_refuse_every_call_without_it(tiny_llama):
    """A process that reaches a worker's port but lacks the cluster secret gets no NIXL metadata
    (the handshake is what lets a peer READ the worker's KV pool), no prefill, no decode; health
    checks stay open for probes. The cluster itself (router -> prefill -> KV pull -> decode)
    serves with the secret on every call."""
    from baton.transfer.cluster_secret import ENV, METADATA_KEY
    from baton.v1 import worker_pb2_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.support.cluster import Cluster

    secret = "s3cret-cluster-" + os.urandom(8).hex()
    args = ["--model", str(tiny_llama[0]), "--num-blocks", "64", "--block-size", "4"]
    with Cluster(prefill=1, decode=1, worker_args=args, env={ENV: secret},
                 routers=[["--local-prefill-max-tokens", "0"]]) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        fingerprint = prefill.info().fingerprint  # the harness's channel carries the secret
        for metadata in ((), ((METADATA_KEY, "wrong"),)):
            with pytest.raises(grpc.RpcError) as e:
                handshake(prefill.address, metadata, fingerprint)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert METADATA_KEY in e.value.details()
        with grpc.insecure_channel(decode.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(worker_pb2_grpc.DecodeWorkerStub(ch).Generate(
                    worker_pb2.LocalRequest(request_id="x", prompt_token_ids=[1, 2, 3]),
                    timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(prefill.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(
                    worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3]),
                    timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = handshake(prefill.address, ((METADATA_KEY, secret),), fingerprint)
        assert ok.agent_metadata and ok.num_blocks == 64

        msgs = list(api_pb2_grpc.BatonStub(c.router.channel).Generate(
            api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=list(range(5, 40))),
                                    params=api_pb2.SamplingParams(max_tokens=4,
                                                                     ignore_eos=True)),
            timeout=120))
        final = msgs[-1].final
        assert final.finish_reason == "length" and final.usage.completion_tokens == 4
        assert final.path == "remote" and final.kv_blocks_read > 0  # pulled with the secret
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert secret not in ps
        c.assert_quiet()
