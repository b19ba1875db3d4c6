"""`baton bench compare` end to end on a tiny random Llama: it starts the disaggregated and the
colocated setup in turn (real redis-server, workers pinned to cores, router), drives both with
the identical workload, and writes the comparison."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_compare_runs_both_setups_on_the_same_workload(tiny_llama, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "bench", "compare", "--model",
         str(tiny_llama[0]), "--num-blocks", "256", "--requests", "5", "--rate", "10",
         "--vocab", "5:400", "--input-len", "8:90", "--output-len", "4", "--ttft-slo", "30",
         "--tpot-slo", "5", "--no-plots", "--quiet", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on core" in out.stderr  # the workers were pinned
    (path,) = tmp_path.glob("bench-compare-*.json")
    res = json.loads(path.read_text())
    assert [r["target"] for r in res["results"]] == ["baton-disaggregated", "baton-colocated"]
    for r in res["results"]:
        (run,) = r["runs"]
        assert run["succeeded"] == 5 and run["attainment"] == 1.0
        assert run["tpot_s"]["n"] == 5
        # each request's own account, in order, with the router's stages of its first token
        rows = run["per_request"]
        assert [r["output"] for r in rows] == [4] * 5 and all(r["error"] is None for r in rows)
        assert all(8 <= r["prompt"] <= 90 and 0 < r["ttft"] <= 30 for r in rows)
        assert all(r["path"] in ("remote", "local") and "prefill" in r["stages"] for r in rows)
        assert sum(r["ttft"] for r in rows) / 5 == pytest.approx(run["ttft_s"]["mean"])
    assert res["args"]["prefill"] == 1 and res["args"]["colocated"] == 2
    assert "baton-colocated" in out.stdout and "baton-disaggregated" in out.stdout


def test_gpu_bench_moe_and_fp8_rows_run_in_smoke_mode(tmp_path):
    # bench/gpu.py's MoE and FP8 parts on CPU under Triton's interpreter, tiny: every row is
    # there, the experts counted are the step's own routing, FP8 reads fewer bytes than bf16
    out = subprocess.run([sys.executable, "-m", "baton.bench.gpu", "--smoke", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("gpu-*.json")
    res = json.loads(path.read_text())
    assert res["smoke"] is True and res["ceilings"]["matmul_fp8_flops"] > 0
    moe = res["moe"]
    for name in ("bf16", "fp8"):
        assert [d["batch"] for d in moe[name]["decode"]] == [1, 4]
        for d in moe[name]["decode"]:
            assert d["logits_finite"] and len(d["experts_read_per_layer"]) == 2
            # top-4 of 16 experts: at least 4 distinct per layer, more for a batch of 4
            assert all(4 <= n <= min(16, 4 * d["batch"]) for n in d["experts_read_per_layer"])
        assert moe[name]["prefill"][0]["tokens"] == 32
    one_bf16, one_fp8 = moe["bf16"]["decode"][0], moe["fp8"]["decode"][0]
    if one_bf16["experts_read_per_layer"] == one_fp8["experts_read_per_layer"]:
        assert one_fp8["weight_bytes"] < one_bf16["weight_bytes"]
    for check in (moe["check"], res["fp8_dense"]["check"]):
        assert check["logits_rel_err"] < 0.05 and check["top1_agrees"]
    assert [d["batch"] for d in res["fp8_dense"]["decode"]] == [1, 4]
    assert "moe    fp8   decode batch   4" in out.stdout
