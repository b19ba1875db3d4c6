"""A worker's /metrics also carries vLLM's load gauges (what KEDA scalers and dashboards written
for vLLM read), equal to Baton's own, on a real engine as requests queue, run and finish."""

from __future__ import annotations

from baton.engine.params import SamplingParams
from baton.services.common.metrics import WorkerMetrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def scraped(metrics: WorkerMetrics) -> dict[str, tuple[float, dict]]:
    text = generate_latest(metrics.registry).decode()
    return {s.name: (s.value, s.labels) for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def test_vllm_gauges_follow_the_engine(tiny_engine):
    eng = tiny_engine(num_kv_blocks=40, block_size=4, max_num_seqs=2)
    m = WorkerMetrics(eng, "decode")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add_request(params=params, prompt_token_ids=list(range(3 + i, 20 + i)))
    g = scraped(m)
    name = eng.model_info.name
    assert g["vllm:num_requests_waiting"] == (3.0, {"model_name": name})
    assert g["vllm:num_requests_running"][0] == 0 and g["vllm:kv_cache_usage_perc"][0] == 0
    eng.step()
    g = scraped(m)
    assert g["vllm:num_requests_running"][0] == g["baton_worker_running_requests"][0] == 2
    assert g["vllm:num_requests_waiting"][0] == g["baton_worker_queue_depth"][0] == 1
    used = g["baton_worker_kv_blocks_used"][0] / g["baton_worker_kv_blocks_total"][0]
    assert 0 < g["vllm:kv_cache_usage_perc"][0] == used < 1
    while eng.has_unfinished():
        eng.step()
    g = scraped(m)
    assert g["vllm:num_requests_running"][0] == g["vllm:num_requests_waiting"][0] == 0
    assert g["vllm:kv_cache_usage_perc"][0] == 0  # cached blocks count as free, as in vLLM
