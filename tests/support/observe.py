"""What tests read off a running cluster: random prompt ids, a process's Prometheus metrics,
and the metric names docs/metrics.md documents."""

from __future__ import annotations

import random
import re
import urllib.request


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 400) for _ in range(n)]


def scrape(address: str, path: str = "/metrics") -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}."""
    body = urllib.request.urlopen(f"http://{address}{path}", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def documented_metrics() -> list[str]:
    """Every metric name in docs/metrics.md's table (``_used``-style shorthands expanded)."""
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    table = page.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in table.splitlines():
        if not line.startswith("| `baton"):
            continue
        last = None
        for name in re.findall(r"`([a-z0-9_]+)(?:\{[a-z_,]*\})?`", line.split("|")[1]):
            if name.startswith("_"):  # `_used` after `baton_worker_kv_blocks_free`
                name = last.rsplit("_", 1)[0] + name
            names.append(name)
            last = name
    return names
