"""Workers on a device: ``--device``, the KV pool's memory as NIXL moves it (DRAM, VRAM, or staged
through a host mirror), and what every path reports about it. Real worker processes, real NIXL.

The CPU tests run everywhere (device "cpu" is one more device; ``--kv-staging always`` takes the
staged path's bookkeeping through a host mirror on CPU). The tests marked ``gpu`` need a CUDA
device and are skipped without one (CI has none; ``bench/gpu_cluster.py`` and a lent GPU run
them)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
import torch
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.params import SamplingParams
from baton.services.launch.local import WorkerProcess, WorkerStartError

from tests.support.pair import eventually, start_pair

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 6,
         "one two three four five six seven eight nine ten", "a b c"]


def _reference(path: str, device: str = "cpu") -> tuple[list[list[int]], list[list[int]]]:
    engine = LLMEngine.from_path(path, EngineConfig(device=device, num_kv_blocks=256))
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    return prompts, [c.token_ids for c in engine.generate(prompts, params)]


def _handoffs(pair, prompts: list[list[int]], tag: str) -> list[tuple[list[int], object]]:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    return [pair.handoff(ids, params, f"{tag}-{i}") for i, ids in enumerate(prompts)]


def _metric(address: str, name: str) -> list[str]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return [ln for ln in text.splitlines() if ln.startswith(name)]


@pytest.mark.slow  # a worker pair, ~10 s: the fast lane keeps the flag checks below
def test_a_cpu_pool_is_registered_as_dram_and_moves_unstaged(tiny_llama):
    path = str(tiny_llama[0])
    prompts, expected = _reference(path)
    pair = start_pair(["--model", path], ["--model", path])
    try:
        got = _handoffs(pair, prompts, "plain")
        assert [t for t, _ in got] == expected
        assert all(not s.transports.startswith("staged-host") for _, s in got)
        for w in (pair.prefill, pair.decode):
            info = w.info()
            assert (info.device, info.kv_memory, info.kv_staged_bytes) == ("cpu", "DRAM", 0)
            assert _metric(w.metrics_address, "baton_kv_pool_memory") == [
                'baton_kv_pool_memory{device="cpu",memory="DRAM"} 1.0']
        pair.assert_idle_and_intact()
    finally:
        pair.stop()


@pytest.mark.slow  # a worker pair, ~6 s
def test_staged_handoffs_give_the_same_tokens_and_say_they_were_staged(tiny_llama):
    """``--kv-staging always``: the holder copies the leased blocks into its registered host
    mirror, the reader READs mirror to mirror and copies them into its pool. Same tokens; the
    transports, worker info and /metrics say so; every block is free afterwards."""
    path = str(tiny_llama[0])
    prompts, expected = _reference(path)
    staged = ["--model", path, "--kv-staging", "always"]
    pair = start_pair(staged, staged)
    try:
        got = _handoffs(pair, prompts, "staged")
        assert [t for t, _ in got] == expected
        read = sum(s.bytes for _, s in got)
        assert read > 0 and all(s.transports.startswith("staged-host") for _, s in got)
        pre, dec = pair.prefill.info(), pair.decode.info()
        for info in (pre, dec):  # the holder stages out, the reader stages in: both say so
            assert info.kv_memory == "DRAM staged through a host mirror"
            assert info.transports.split(",")[0] == "staged-host", info.transports
        # the holder staged out every leased block; the reader staged in every block it read,
        # and the one block it probed its peer with at start-up (--peers)
        assert dec.kv_staged_bytes == read + _block_nbytes(path)
        assert pre.kv_staged_bytes >= read
        [line] = _metric(pair.decode.metrics_address, "baton_kv_staged_bytes ")
        assert float(line.split()[1]) == dec.kv_staged_bytes
        pair.assert_idle_and_intact()
    finally:
        pair.stop()


def test_a_worker_asked_for_a_gpu_it_does_not_have_says_so(tiny_llama):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(WorkerStartError, match="CUDA is not available here"):
        WorkerProcess("prefill", ["--model", str(tiny_llama[0]), "--device", "cuda"])


@pytest.mark.parametrize("flags, says", [
    (["--device", "gpu"], "--device gpu: must be auto, cpu, cuda or cuda:N"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0: must be in (0, 1]"),
    (["--kv-staging", "sometimes"], "invalid choice: 'sometimes'"),
])
def test_device_flags_are_checked_before_anything_loads(flags, says):
    with pytest.raises(WorkerStartError, match=says.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        WorkerProcess("decode", flags, ready_timeout=60)


# ---- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("staging", ["auto", "always"])
def test_gpu_workers_hand_off_vram_and_match_the_gpu_engine(tiny_llama, staging):
    """Two workers on the GPU: the pool sized from the device's share, registered as VRAM and
    read VRAM to VRAM (cuda_ipc), or staged through pinned host memory when asked; the tokens are
    the in-process CUDA engine's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(tiny_llama[0])
    prompts, expected = _reference(path, "cuda")
    args = ["--model", path, "--device", "cuda", "--gpu-memory-utilization", "0.2",
            "--kv-staging", staging]
    pair = start_pair(args, args)
    try:
        got = _handoffs(pair, prompts, f"gpu-{staging}")
        assert [t for t, _ in got] == expected
        info = pair.decode.info()
        assert info.device == "cuda"
        if staging == "auto":
            assert info.kv_memory == "VRAM"
            assert "cuda_ipc" in info.transports, info.transports
        else:
            assert info.kv_memory == "VRAM staged through pinned host memory"
            assert info.transports.startswith("staged-host")
        eventually(lambda: pair.decode.info(), lambda i: i.num_free_blocks == i.num_blocks)
        pair.assert_idle_and_intact()
    finally:
        pair.stop()


@pytest.mark.gpu
def test_a_gpu_worker_sizes_its_pool_from_its_share_of_the_device(tiny_llama):
    total = torch.cuda.get_device_properties(0).total_memory
    w = WorkerProcess("decode", ["--model", str(tiny_llama[0]), "--device", "cuda",
                                 "--gpu-memory-utilization", "0.1"])
    try:
        info = w.info()
        log = w.log_tail(200)
        assert "KV pool on cuda" in log and "this engine's share 10%" in log, log
        pool = info.num_blocks * _block_nbytes(tiny_llama[0])
        # the share, less the context, the weights and the activation reserve (>= 512 MiB)
        assert 0 < pool < 0.1 * total - (512 << 20), (pool, total)
    finally:
        w.stop()


def _block_nbytes(path) -> int:
    from baton.engine.loader import load_model
    from baton.engine.runner import ModelRunner

    return ModelRunner.block_nbytes(load_model(str(path)).config, EngineConfig())


# ---- baton up ------------------------------------------------------------------------------------


def test_baton_up_asked_for_gpus_where_there_are_none_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "baton.cli.main", "up", "--device", "cuda",
                          "--log-dir", str(tmp_path), "--http-port", "-1", "--grpc-port", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--device cuda, but no GPU is visible" in out.stdout + out.stderr


@pytest.mark.gpu
def test_baton_up_on_a_gpu_machine_runs_its_workers_on_the_gpus(tiny_llama, tmp_path):
    """Each worker gets a GPU (sharing them, with a stated share, when there are fewer GPUs
    than workers); a prompt goes the remote way, VRAM to VRAM."""
    from baton.bench.common import worker_infos
    from baton_client.v1 import api_pb2, api_pb2_grpc

    from tests.support.up import Up

    up = Up(tmp_path, "--model", str(tiny_llama[0]), "--device", "cuda", "--prefill", "1",
            "--decode", "1", "--http-port", "-1", "--local-prefill-max-tokens", "0")
    try:
        text = "".join(up.lines)
        gpus = torch.cuda.device_count()
        assert f"{gpus} GPU(s) for 2 worker(s)" in text, text
        if gpus == 1:
            assert "GPU 0 (45% of its memory), GPU 0 (45% of its memory)" in text, text
        infos, gone = worker_infos(up.redis_url, up.secret)
        assert gone == 0 and len(infos) == 2
        assert {(i.device, i.kv_memory) for i in infos.values()} == {("cuda", "VRAM")}
        final = None
        for m in api_pb2_grpc.BatonStub(up.router.channel).Generate(api_pb2.GenerateRequest(
                text="the quick brown fox " * 8, params=api_pb2.SamplingParams(
                    max_tokens=8, ignore_eos=True)), timeout=120):
            final = m.final if m.HasField("final") else final
        assert final is not None and final.path == "remote", final
        assert "cuda_ipc" in final.transports or gpus > 1, final.transports
        up.assert_quiet(workers=2)
    finally:
        assert up.stop() == 0
