"""Helpers shared by Baton's benchmarks: the machine description, workload prompts, result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import random
import signal
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# `python bench/<script>.py` puts bench/ first on sys.path, where bench/profile.py hides the
# standard library's profile module (cProfile imports it, and transformers imports cProfile:
# building the tiny test model failed). Every script imports this module first, so dropping
# the folder here keeps the scripts runnable; they import each other as baton.bench.*.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != RESULTS.parent]


def machine() -> dict:
    """What the numbers were measured on."""
    info = {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0))}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split()
        from baton.engine.config import SPEED_FLAGS

        info["cpu_flags"] = [f for f in SPEED_FLAGS if f in flags]
    except OSError:
        pass
    try:
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["mem_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    # the engine's CPU weights and KV pool on transparent huge pages (1, the default) or not
    # (engine/model.py): a start ~6.7x and a decode ~1.03x apart on the 2-vCPU VM
    # (bench/huge_pages.py), so a figure says which it ran under
    info["baton_huge_pages"] = os.environ.get("BATON_HUGE_PAGES", "1")
    return info


def other_processor(profile) -> str | None:
    """How ``profile`` (a :class:`baton.control.profile.Profile`) was measured on another
    processor than this machine's CPU, where a benchmark's workers run, or None (the same, or
    a profile or machine that does not say): "measured on X, this machine is Y"."""
    from baton.engine.config import processor

    theirs, here = profile.processor, processor("cpu")
    if theirs and here and theirs != here:
        return f"measured on {theirs}, this machine is {here}; `baton profile` here"
    return None


def random_word_prompts(tokenizer, lengths: list[int], seed: str) -> list[list[int]]:
    """Prompts of exactly ``lengths[i]`` tokens of random vocabulary words (no shared prefixes,
    so a prefix cache never serves them). Same recipe as the vLLM peer's ``peer_bench.py``."""
    rng = random.Random(seed)
    vocab = [tokenizer.token_to_str(i) for i in range(tokenizer.vocab_size)]
    words = [t[1:] for t in vocab if t.startswith("\u0120") and t[1:].isalpha() and len(t) > 3]
    out = []
    for n in lengths:
        text = " ".join(rng.choice(words) for _ in range(n + 8))
        out.append(tokenizer.encode(text, add_special_tokens=False)[:n])
    return out


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of xs, linearly interpolated between closest ranks (numpy's
    default); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def settle(idle: float = 0.9, window_s: float = 0.5, max_s: float = 15.0) -> float:
    """Wait until the machine's CPUs are at least ``idle`` idle over ``window_s`` (at most
    ``max_s``), so a run does not start while the previous one's processes still spin (a peer
    server's OpenMP threads keep a core busy for a while after its last request). Returns the
    seconds waited; without /proc/stat, waits ``window_s``."""
    t0 = time.monotonic()

    def ticks():
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return vals[3] + vals[4], sum(vals)  # idle + iowait, total

    try:
        while True:
            i0, t_0 = ticks()
            time.sleep(window_s)
            i1, t_1 = ticks()
            if t_1 == t_0 or (i1 - i0) / (t_1 - t_0) >= idle or time.monotonic() - t0 > max_s:
                return time.monotonic() - t0
    except OSError:
        time.sleep(window_s)
        return window_s


_PAUSE_LOOP = """
import os, sys, time
least, last, parent = float(sys.argv[1]), time.monotonic(), os.getppid()
print("watching", flush=True)
while os.getppid() == parent:  # not past its benchmark, even one killed outright
    time.sleep(0.2)
    now = time.monotonic()
    if now - last - 0.2 > least:
        print(f"{now:.3f} {now - last - 0.2:.3f}", flush=True)
    last = now
"""


class PauseWatch:
    """When the machine stopped (or left a process without a CPU) for over ``least_s``: a
    child process of its own (none of the load generator's threads contend with it) sleeps
    0.2 s at a time and notes each wake-up that came over ``least_s`` late. A run whose
    clients and servers all stopped together (the VM paused: over 20 s in runs 34 and 36 of
    docs/routing.md, ~31 s by the kernel's "workqueue lockup" line in 36) is not the layout's
    doing, and its result says when and for how long."""

    def __init__(self, least_s: float = 2.0) -> None:
        import subprocess
        import threading

        self.t0, self.pauses, self.watching = time.monotonic(), [], threading.Event()
        self.proc = subprocess.Popen([sys.executable, "-c", _PAUSE_LOOP, str(least_s)],
                                     stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("watching"):
                self.watching.set()
                continue
            at, gap = (float(v) for v in line.split())
            self.pauses.append({"at_s": round(at - gap - self.t0, 1), "s": round(gap, 1)})

    def stop(self) -> list[dict]:
        """The pauses seen: [{"at_s": seconds from the start, "s": how long}, ...]."""
        self.proc.terminate()
        self.proc.wait(30)
        self._reader.join(30)
        return list(self.pauses)


def run_threads(target, n: int) -> None:
    """``target()`` on ``n`` threads at once; returns when every one has."""
    import threading

    threads = [threading.Thread(target=target) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"{name}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children, theirs, ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
        except OSError:  # gone meanwhile
            continue
    return out


def worker_infos(redis_url: str, secret: str | None) -> tuple[dict, int]:
    """``WorkerInfo`` (integrity checked) of every registered worker that answers, by worker
    id, and how many did not (a killed worker's entry, until it lapses)."""
    import grpc
    from baton.control.registry import WorkerRegistry
    from baton.transfer import cluster_secret
    from baton.v1 import worker_pb2, worker_pb2_grpc

    infos, gone = {}, 0
    for w in WorkerRegistry.from_url(redis_url).workers():
        with cluster_secret.channel(w.address, secret=secret) as ch:
            stub = (worker_pb2_grpc.PrefillWorkerStub(ch) if w.role == "prefill"
                    else worker_pb2_grpc.DecodeWorkerStub(ch))
            try:
                infos[w.worker_id] = stub.Info(worker_pb2.InfoRequest(check_integrity=True),
                                               timeout=30)
            except grpc.RpcError:
                gone += 1
    return infos, gone


@contextmanager
def sigterm_as_ctrl_c():
    """Inside, SIGTERM (as `timeout` or `kill` send it) raises KeyboardInterrupt, so a
    benchmark stopped that way runs the cleanup it runs on Ctrl-C (its workers, routers and
    Redis stopped) rather than dying and leaving them running; the caller's handler is back
    after."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
