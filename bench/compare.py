"""``baton bench compare``: disaggregated against colocated Baton on the same cores.

Each setup runs alone (the other is stopped) on the same cores: disaggregated is
``--prefill`` prefill workers and ``--decode`` decode workers, colocated is ``--colocated``
workers that prefill and decode themselves (``--role both``), each worker pinned to one core
with one torch thread; a router and an embedded redis-server serve both. The identical workload
(same seeds; fresh prompt tokens per run, so no run hits another's prefix cache) is sent to
each, and to every ``--peer`` (an OpenAI-compatible server started separately, e.g. vLLM).
After a goodput search, every target is also run at the colocated setup's goodput rate, where
the p99 TPOT of each is compared.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import replace

from baton.bench import loadgen as lg
from baton.bench.cli import CompareConfig, Progress, measure, save, table


def _cores(a: CompareConfig, n: int) -> list[int]:
    cores = ([int(c) for c in a.cores.split(",")] if a.cores
             else sorted(os.sched_getaffinity(0)))
    if len(cores) < n:  # more workers than cores: they share, round-robin
        cores = [cores[i % len(cores)] for i in range(n)]
    return cores[:n]


class Setup:
    """A running Baton cluster: redis, workers pinned one per core, a router."""

    def __init__(self, a: CompareConfig, kind: str, redis_url: str) -> None:
        from baton.services.launch.local import WorkerProcess

        self.kind, self.procs = kind, []
        common = ["--redis-url", redis_url, "--dtype", a.dtype, "--threads", "1",
                  "--metrics-port", "-1"]
        if a.model:
            common += ["--model", a.model]
        if a.num_blocks:
            common += ["--num-blocks", str(a.num_blocks)]
        roles = (["prefill"] * a.prefill + ["decode"] * a.decode if kind == "disaggregated"
                 else ["both"] * a.colocated)
        cores = _cores(a, len(roles))
        try:
            for role, core in zip(roles, cores):
                args = list(common)
                if role == "both":
                    args += ["--role", "both"]
                peers = [p.address for p in self.procs if p.role == "prefill"]
                if role == "decode" and peers:  # connect (and probe) before serving
                    args += ["--peers", ",".join(peers)]
                self.procs.append(WorkerProcess("prefill" if role == "prefill" else "decode",
                                                args, cpus={core}))
                print(f"  {kind}: {role} worker {self.procs[-1].worker_id} on core {core}",
                      file=sys.stderr)
            router = ["--redis-url", redis_url, "--http-port", "-1"]
            if kind == "colocated":  # every request on one worker, as `baton up --colocated`
                router += ["--local-prefill-max-tokens", str(1 << 30)]
            elif a.local_prefill_max_tokens is not None:
                router += ["--local-prefill-max-tokens", str(a.local_prefill_max_tokens)]
            router += shlex.split(a.router_args)
            self.router = WorkerProcess("router", router)
            self.procs.append(self.router)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop(timeout=30)


def compare(a: CompareConfig) -> int:
    results = run_compare(a)
    if results is None:
        return 2
    summary = _summary(results)
    print(table(results))
    for line in summary["lines"]:
        print(line)
    for p in save(a, "compare", {"results": results, "summary": summary}):
        print(f"wrote {p}")
    return 0


def run_compare(a: CompareConfig) -> list[dict] | None:
    """Measure every setup and peer; None when the arguments are wrong (said on stderr)."""
    kinds = (a.only or "disaggregated,colocated").split(",")
    load = a.load
    if not (load.goodput or load.rate or load.speedup or load.concurrency):
        load = replace(load, goodput=True)
    progress = Progress(a.output.quiet)
    results: list[dict] = []
    targets: dict[str, tuple] = {}  # name -> (start, stop) of its target
    for kind in kinds:
        targets[f"baton-{kind}"] = ("baton", kind)
    for spec in a.peer:
        name, _, url = spec.partition("=")
        if not url:
            print(f"error: --peer {spec!r}: want NAME=URL", file=sys.stderr)
            return None
        targets[name] = ("peer", url)
    for name in targets:
        print(f"== {name}", file=sys.stderr)
        target, close = _open_target(a, targets[name])
        try:
            lg.warm_up(target, a.workload.vocab)
            results.append(measure(target, a.workload, load, name, progress))
        finally:
            (close or target.close)()
    # the colocated setup's goodput rate: every target once more at that rate (p99 TPOT there)
    ref = next((r for r in results if r["target"] == "baton-colocated"), None)
    if load.goodput and ref and ref["goodput_rps"] > 0 and a.rerun:
        for res in results:
            _rerun_at(a, targets[res["target"]], res, load, ref["goodput_rps"], progress)
    return results


def _open_target(a: CompareConfig, how_what: tuple):
    """(target, its close or None): a peer's URL, or a Baton setup started with its own Redis."""
    from baton.control.redis_server import EmbeddedRedis

    how, what = how_what
    if how == "peer":
        return lg.OpenAITarget(what), None
    redis = EmbeddedRedis().start()
    try:
        setup = Setup(a, what, redis.url)
    except BaseException:
        redis.stop()
        raise
    t = lg.GrpcTarget(setup.router.address)
    return t, lambda: (t.close(), setup.stop(), redis.stop())


def _rerun_at(a: CompareConfig, how_what: tuple, res: dict, load, rate: float,
              progress) -> None:
    """One more run of ``res``'s target at ``rate`` (the colocated setup's goodput)."""
    name = res["target"]
    try:  # a setup that fails to start again must not lose the searches before
        target, close = _open_target(a, how_what)
    except Exception as e:
        res["at_colocated_goodput_error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"  {name}: could not start for the run at {rate:.3g} req/s: "
              f"{type(e).__name__}", file=sys.stderr)
        return
    try:
        at = replace(load, goodput=False, rate=rate)
        res["at_colocated_goodput"] = measure(target, a.workload, at, name, progress)["runs"][0]
        res["runs"].append(res["at_colocated_goodput"])
    finally:
        (close or target.close)()


def _summary(results: list[dict]) -> dict:
    by = {r["target"]: r for r in results}
    out: dict = {"lines": []}
    d, c = by.get("baton-disaggregated"), by.get("baton-colocated")
    if d and c and "goodput_rps" in d:
        ratio = d["goodput_rps"] / c["goodput_rps"] if c["goodput_rps"] else None
        out["goodput_ratio_disaggregated_over_colocated"] = ratio
        out["lines"].append(f"goodput: disaggregated {d['goodput_rps']:.3g} req/s, colocated "
                            f"{c['goodput_rps']:.3g} req/s, ratio "
                            f"{'-' if ratio is None else f'{ratio:.2f}'}")
        if "at_colocated_goodput" in d and "at_colocated_goodput" in c:
            pd_, pc = (x["at_colocated_goodput"]["tpot_s"]["p99"] for x in (d, c))
            if pd_ and pc:
                out["p99_tpot_ratio_colocated_over_disaggregated"] = pc / pd_
                out["lines"].append(
                    f"p99 TPOT at the colocated goodput rate: disaggregated {pd_ * 1000:.0f} ms, "
                    f"colocated {pc * 1000:.0f} ms ({pc / pd_:.2f}x)")
    for name, r in by.items():
        if not name.startswith("baton-") and "goodput_rps" in r:
            out["lines"].append(f"goodput {name}: {r['goodput_rps']:.3g} req/s")
    return out
