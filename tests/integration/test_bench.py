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
    assert res["args"]["prefill"] == 1 and res["args"]["colocated"] == 2
    assert "baton-colocated" in out.stdout and "baton-disaggregated" in out.stdout
