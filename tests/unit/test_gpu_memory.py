"""Devices without a device: the KV pool's sizing on a GPU (pure arithmetic on measured numbers),
fingerprints per device kind, a router's pool leaving other fingerprints out, ``baton up``'s GPU
placement, and the staged agent's bookkeeping on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from baton.cli.up import place_on_gpus, visible_gpus
from baton.control.registry import WorkerRecord
from baton.engine.config import EngineConfig, ModelConfig, model_fingerprint
from baton.engine.errors import InvalidRequestError
from baton.engine.gpu_memory import MIN_RESERVE, activation_reserve, plan_kv_pool
from baton.services.router.workers import WorkerPool
from baton.transfer.agent import _runs

GiB = 1 << 30


def _plan(**kw):
    args = dict(device="cuda:0 (test)", total=80 * GiB, free_now=79 * GiB, context=GiB // 2,
                weights=GiB, reserve=GiB, utilization=0.9, block_nbytes=2 << 20)
    args.update(kw)
    return plan_kv_pool(**args)


def test_the_pool_gets_the_share_left_after_context_weights_and_reserve():
    plan = _plan()
    left = int(0.9 * 80 * GiB) - GiB // 2 - GiB - GiB
    assert plan.num_blocks == left // (2 << 20)
    assert plan.kv_bytes <= left < plan.kv_bytes + (2 << 20)
    text = plan.describe()
    assert "share 90% = 72.00 GiB" in text and f"{plan.num_blocks} blocks of 2048 KiB" in text


def test_the_pool_never_takes_more_than_the_device_has_free():
    # another process on the GPU holds 60 GiB: the share says 69.5 GiB, the device has 20
    plan = _plan(free_now=20 * GiB)
    assert plan.kv_bytes <= 20 * GiB - GiB - (256 << 20)
    assert plan.num_blocks == (20 * GiB - GiB - (256 << 20)) // (2 << 20)


def test_a_share_too_small_for_one_block_is_refused_with_the_numbers():
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization.*leaves no room.*"
                                                  "weights 1.00 GiB"):
        _plan(utilization=0.02)


def test_the_activation_reserve_grows_with_the_step_and_has_a_floor():
    small = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16, 256)
    assert activation_reserve(small, 16, 1, 4) == MIN_RESERVE
    big = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 8192)
    r1 = activation_reserve(big, 8192, 64, 2)
    assert r1 > MIN_RESERVE and activation_reserve(big, 16384, 64, 2) > 1.8 * r1


def test_fingerprints_name_the_device_kind_not_the_index():
    cfg = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16, 256)
    cpu = model_fingerprint(cfg, "w", "float32", 16, "cpu")
    assert cpu != model_fingerprint(cfg, "w", "float32", 16, "cuda")
    assert model_fingerprint(cfg, "w", "float32", 16, "cuda") == model_fingerprint(
        cfg, "w", "float32", 16, "cuda:3")


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:a", "CPU"])
def test_an_engine_device_other_than_cpu_cuda_or_cuda_n_is_refused(device):
    with pytest.raises(InvalidRequestError, match="must be cpu, cuda or cuda:N"):
        EngineConfig(device=device)


class _Registry:
    def __init__(self, workers):
        self.list = workers

    def workers(self):
        return self.list


def test_a_router_leaves_out_workers_of_another_fingerprint(caplog):
    ws = [WorkerRecord("p-gpu", "prefill", "127.0.0.1:1", "fp-cuda", "i1"),
          WorkerRecord("p-cpu", "prefill", "127.0.0.1:2", "fp-cpu", "i2"),
          WorkerRecord("d-gpu", "decode", "127.0.0.1:3", "fp-cuda", "i3")]
    pool = WorkerPool(_Registry(ws), refresh_s=0.0)
    assert len(pool.workers()) == 3  # before the router knows its model: every worker
    pool.pin_fingerprint("fp-cuda")
    assert [w.worker_id for w in pool.workers()] == ["p-gpu", "d-gpu"]
    assert [w.worker_id for w in pool.workers("prefill")] == ["p-gpu"]
    warned = [r.getMessage() for r in caplog.records if "p-cpu" in r.getMessage()]
    assert len(warned) == 1 and "not routing to it" in warned[0]  # named once, not per read


def test_baton_up_spreads_workers_over_gpus_and_splits_shared_ones():
    assert place_on_gpus(2, ["0", "1"], 0.9) == [("0", 0.9), ("1", 0.9)]
    assert place_on_gpus(4, ["0", "1"], 0.9) == [("0", 0.45), ("1", 0.45)] * 2
    assert place_on_gpus(3, ["5"], 0.6) == [("5", 0.2)] * 3


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_runs_of_consecutive_block_ids():
    assert _runs([3, 4, 5, 9, 10, 2]) == [(3, 6), (9, 11), (2, 3)]
    assert _runs([]) == []


def test_a_staged_agent_registers_its_mirror_and_copies_only_the_blocks_asked():
    from baton.transfer.agent import KVAgent

    kv = torch.arange(6 * 8, dtype=torch.float32).view(6, 8).contiguous()
    agent = KVAgent("staged-unit", kv, staging="always")
    try:
        assert agent.staged and agent.host is not None and agent.host.data_ptr() != kv.data_ptr()
        assert agent.base == agent.host.data_ptr() and agent.mem_type == "DRAM"
        agent.stage_out([1, 2, 4])
        assert torch.equal(agent.host[[1, 2, 4]], kv[[1, 2, 4]])
        assert not agent.host[[0, 3, 5]].any()
        assert agent.staged_bytes == 3 * kv[0].nbytes
        assert agent.transports().startswith("staged-host")
    finally:
        agent.close()
    plain = KVAgent("plain-unit", kv)
    try:
        assert not plain.staged and plain.base == kv.data_ptr() and plain.memory == "DRAM"
        plain.stage_out([1])  # nothing to stage
        assert plain.staged_bytes == 0
    finally:
        plain.close()
