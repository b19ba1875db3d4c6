"""``baton up``: the whole cluster on one machine, as local processes.

Starts a real redis-server (the embedded one, unless ``--redis-url``), the prefill and decode
workers (or colocated ones), and the router; waits until each serves; prints the endpoints;
on Ctrl-C or SIGTERM stops them in reverse order (workers drain) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from baton.control.redis_client import redact
from baton.engine.families import MODEL_HELP
from baton.services.common.config import (
    DEFAULT_KV_CACHE_GB,
    DTYPES,
    KV_CACHE_GB_ENV,
    kv_cache_gb,
)
from baton.transfer import cluster_secret

from baton import set_on_signals

if TYPE_CHECKING:
    from baton.control.autoscale import ScalingConfig


def add_up_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    ap.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    ap.add_argument("--colocated", type=int, default=0,
                    help="instead of separate pools: N workers that prefill and decode")
    ap.add_argument("--redis-url", default=os.environ.get("BATON_REDIS_URL"),
                    help="use this Redis instead of starting the embedded redis-server "
                         "(default $BATON_REDIS_URL, which keeps a password off every command "
                         "line: the workers and the router get the URL in their environment)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--grpc-port", type=int, default=50051, help="the router's gRPC API")
    ap.add_argument("--http-port", type=int, default=8000,
                    help="the router's OpenAI-compatible HTTP API (-1: none)")
    _add_worker_args(ap)
    ap.add_argument("--local-prefill-max-tokens", type=int, default=64,
                    help="the decode worker prefills itself when it lacks at most this many of "
                         "a prompt's tokens (prefix-cache hits excluded) (default 64)")
    ap.add_argument("--routing", default="cache-aware",
                    choices=["cache-aware", "least-loaded", "round-robin"],
                    help="the router's policy (default cache-aware: Redis prefix index + load)")
    ap.add_argument("--log-dir", default=None,
                    help="where the processes' logs go (made when missing; default a new "
                         "temporary folder, named at start)")
    ap.add_argument("--router-args", default="",
                    help="more options for the router, e.g. \"--max-concurrent 64 "
                         "--max-concurrent-per-key 8 --max-tokens 1024\" (see python -m "
                         "baton.services.router --help)")
    _add_security_args(ap)
    _add_scaling_args(ap)


def _add_worker_args(ap: argparse.ArgumentParser) -> None:
    """What every worker gets: its model, dtype, pool, device and tiers."""
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="each CPU worker's KV pool in GiB, when --num-blocks is not given "
                         f"(default ${KV_CACHE_GB_ENV}, else {DEFAULT_KV_CACHE_GB:g})")
    ap.add_argument("--device", default="auto", type=_device,
                    help="where the workers run: cuda gives each worker its own GPU (the ones "
                         "CUDA_VISIBLE_DEVICES names, else all), round-robin when there are "
                         "fewer GPUs than workers; cuda:N puts every worker on GPU N, sharing "
                         "--gpu-memory-utilization; auto: cuda when a GPU is visible, else cpu "
                         "(default auto)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="the share of each GPU's memory the workers on it may use together; "
                         "k workers sharing a GPU get a k-th each, stated at start (default "
                         "0.9)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="every worker's KV cache: auto (the --dtype) or fp8 (e4m3 with "
                         "per-layer scales: twice the blocks of bf16; GPU only) (default auto)")
    ap.add_argument("--prefill-tp", type=int, default=1,
                    help="tensor-parallel ranks per prefill worker: each worker is a group of "
                         "this many processes holding 1/N of the weights each (on CPU, one "
                         "torch thread per rank; on a GPU, every rank of a group on that "
                         "worker's GPU) (default 1)")
    ap.add_argument("--decode-tp", type=int, default=1,
                    help="tensor-parallel ranks per decode (or --colocated) worker; any "
                         "--prefill-tp hands off to any --decode-tp whose KV heads map "
                         "(default 1)")
    ap.add_argument("--kv-host-tier-gb", type=float, default=None,
                    help="GPU workers: pinned host memory per worker for the blocks its KV pool "
                         "evicts (default 4; 0: off)")
    ap.add_argument("--kv-disk-tier-gb", type=float, default=0.0,
                    help="local disk per worker for the blocks its KV pool (and host tier) "
                         "evicts, loaded back on a prefix hit (default 0: off). Each worker "
                         "start slot has its own directory under the cache folder "
                         "(kv-tier/up-<grpc port>-<slot>), so a restarted worker revalidates "
                         "what its predecessor wrote")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per worker (default: this machine's cores shared out "
                         "among the workers, at least 1 each; several workers with every core "
                         "each spin against each other. Under --ray: torch's own default)")


def _device(value: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N (the values a worker's --device takes)."""
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:")
                                            and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: want auto, cpu, cuda or cuda:N")


def _add_security_args(ap: argparse.ArgumentParser) -> None:
    sec = ap.add_argument_group("security (the router's public APIs)")
    sec.add_argument("--auth-token", default=None,
                     help="require this bearer token on gRPC calls and /v1/* (default: "
                          "$BATON_AUTH_TOKEN if set, else none)")
    sec.add_argument("--api-keys-file", default=None,
                     help="more accepted keys, one per line (default: $BATON_API_KEYS_FILE "
                          "if set)")
    sec.add_argument("--tls-cert", default=None, help="PEM certificate: serve over TLS")
    sec.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")


def _add_scaling_args(ap: argparse.ArgumentParser) -> None:
    """Autoscaling and Ray."""
    from baton.control.autoscale import add_policy_args

    s = ap.add_argument_group(
        "autoscaling (--autoscale)",
        "Grow and shrink each pool from the routers' metrics: TTFT p90 (queue wait included) "
        "against --ttft-slo drives the prefill pool, TPOT p90 against --tpot-slo and KV usage "
        "the decode pool (colocated: one pool, all three). A pool grows when pressure (signal / "
        "target) exceeds 1, shrinks by one worker, drained, after pressure stayed below 0.5 for "
        "--scale-down-after seconds; in between nothing changes.")
    s.add_argument("--autoscale", action="store_true", help="turn autoscaling on")
    add_policy_args(s, min_default="the starting count, at least 1")
    g = ap.add_argument_group("Ray")
    g.add_argument("--ray", default=None, metavar="ADDRESS|local",
                   help="run the workers as Ray actors: 'local' starts a Ray instance on this "
                        "machine, an address (ray://host:10001 or host:6379) joins a cluster; "
                        "the router and Redis run here, workers register in that Redis")
    g.add_argument("--ray-cpus-per-worker", type=float, default=None,
                   help="Ray CPUs each worker actor asks for (default: --threads, else 1)")
    g.add_argument("--ray-gpus-per-worker", type=float, default=None,
                   help="Ray GPUs each worker actor asks for; Ray gives the actor those GPUs "
                        "and the worker runs on them (default: 1 with --device cuda, or with "
                        "auto when the Ray cluster has GPUs; else 0)")


@dataclass(frozen=True)
class UpConfig:
    """`baton up`'s settings (:func:`add_up_args`' flags, by their names), built once from the
    command line; ``scaling`` is set with --autoscale."""

    prefill: int
    decode: int
    colocated: int
    redis_url: str | None
    host: str
    grpc_port: int
    http_port: int
    model: str | None
    dtype: str
    num_blocks: int | None
    kv_cache_gb: float | None
    device: str
    gpu_memory_utilization: float
    threads: int | None
    kv_cache_dtype: str
    prefill_tp: int
    decode_tp: int
    kv_host_tier_gb: float | None
    kv_disk_tier_gb: float
    local_prefill_max_tokens: int
    routing: str
    log_dir: str | None
    router_args: str
    auth_token: str | None
    api_keys_file: str | None
    tls_cert: str | None
    tls_key: str | None
    ray: str | None
    ray_cpus_per_worker: float | None
    ray_gpus_per_worker: float | None
    scaling: ScalingConfig | None

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> UpConfig:
        from baton.control.autoscale import ScalingConfig

        names = [f.name for f in fields(cls) if f.name != "scaling"]
        return cls(**{n: getattr(a, n) for n in names},
                   scaling=ScalingConfig.from_args(a) if a.autoscale else None)

    @property
    def pools(self) -> list[str]:
        return ["decode"] if self.colocated else ["prefill", "decode"]

    def policies(self) -> dict:
        """The autoscaler's PoolPolicy per pool (ValueError names bad values)."""
        assert self.scaling is not None
        return self.scaling.policies(self.pools, {"prefill": self.prefill,
                                                  "decode": self.colocated or self.decode})


def _check(a: UpConfig) -> str:
    """What is wrong with the flags ("" when nothing is)."""
    if a.colocated < 0 or a.prefill < 0 or a.decode < 0:
        return "worker counts must be >= 0"
    if not a.colocated and a.decode < 1:
        return "--decode must be >= 1 (or use --colocated N)"
    if not 0 < a.gpu_memory_utilization <= 1:
        return f"--gpu-memory-utilization {a.gpu_memory_utilization}: must be in (0, 1]"
    if a.kv_disk_tier_gb < 0 or (a.kv_host_tier_gb or 0) < 0:
        return "--kv-host-tier-gb and --kv-disk-tier-gb must be >= 0"
    if a.prefill_tp < 1 or a.decode_tp < 1:
        return "--prefill-tp and --decode-tp must be >= 1"
    if a.kv_cache_gb is not None:
        try:
            kv_cache_gb(a.kv_cache_gb, a.num_blocks)
        except ValueError as e:
            return str(e)
    if a.ray and max(a.prefill_tp, a.decode_tp) > 1:
        return ("--prefill-tp/--decode-tp > 1 with --ray: a Ray placement group per worker is "
                "not built yet; run the cluster without --ray")
    if a.kv_cache_dtype == "fp8" and not a.ray and (a.device == "cpu" or not visible_gpus()):
        return ("--kv-cache-dtype fp8: an FP8 KV cache is read by the Triton attention "
                "kernels and needs GPU workers (no GPU is visible, or --device cpu)")
    if a.scaling is not None:
        try:
            a.policies()
        except ValueError as e:
            return f"autoscaling: {e}"
    return ""


def _preflight(a: UpConfig) -> str:
    """What can be checked before any process starts ("" when all is well): the workers'
    ``$BATON_HUGE_PAGES``, the model is there and of a kind Baton serves, and the router's
    ports are free."""
    import socket

    from baton.engine.errors import ModelLoadError
    from baton.engine.loader import check_model
    from baton.engine.model import huge_pages

    try:  # every worker reads it: one bad value, refused before any of them starts
        huge_pages()
    except ValueError as e:
        return str(e)
    try:
        check_model(a.model)
    except ModelLoadError as e:
        return f"--model: {e}"
    for flag, port in (("--grpc-port", a.grpc_port), ("--http-port", a.http_port)):
        if port <= 0:
            continue
        with socket.socket() as s:
            # as the router's servers bind (uvicorn, gRPC): the connections of a cluster just
            # stopped, left in TIME_WAIT for a minute, do not hold the port; a listener does
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((a.host, port))
            except OSError as e:
                return f"{flag} {port}: cannot listen on {a.host}:{port} ({e.strerror})"
    return ""


def up(args: argparse.Namespace) -> int:
    return run(UpConfig.from_args(args))


def run(a: UpConfig) -> int:
    from baton.control.redis_server import RedisStartError
    from baton.services.launch.local import WorkerStartError

    problem = _check(a) or _preflight(a)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    stop = threading.Event()
    set_on_signals(stop)
    cluster = _LocalCluster(a)
    try:
        cluster.start()
        return cluster.watch(stop)
    except (WorkerStartError, RedisStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # Ray's errors (a worker actor that failed to start) and the like
        if not a.ray:
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def visible_gpus() -> list[str]:
    """The GPUs this machine lets Baton use: CUDA_VISIBLE_DEVICES's entries when it is set,
    else every GPU torch sees (none without a CUDA build of torch or a driver)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    if not (Path("/proc/driver/nvidia").exists() or Path("/dev/nvidiactl").exists()):
        return []  # no driver: spare the torch import
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def place_on_gpus(workers: int, gpus: list[str], utilization: float) -> list[tuple[str, float]]:
    """(GPU, memory share) for each of ``workers`` in start order: worker i on GPU i mod n, and
    the workers sharing a GPU splitting ``utilization`` of it evenly.

    >>> place_on_gpus(3, ["0", "1"], 0.9)
    [('0', 0.45), ('1', 0.9), ('0', 0.45)]
    """
    on = [gpus[i % len(gpus)] for i in range(workers)]
    return [(g, round(utilization / on.count(g), 4)) for g in on]


def threads_each(workers: int) -> int:
    """Torch threads per worker when ``workers`` share this machine's cores."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))


@dataclass
class _Slot:
    """One process ``baton up`` supervises: how to start it again, and how often it has been."""

    what: str  # "decode worker", "router", ...
    start: Callable[[], object]
    restarts: int = 0
    due: float | None = None  # when its next start is due (it exited)

    def backoff(self) -> float:
        """Seconds before restart number ``restarts``: 1, 2, 4, ... at most 30."""
        return min(30.0, 2.0 ** (self.restarts - 1))


class _LocalCluster:
    """The processes of one ``baton up``, started in order and stopped in reverse. A worker or
    the router that exits is started again (after a backoff) while the rest keep serving;
    only Ctrl-C stops the cluster."""

    def __init__(self, a: UpConfig) -> None:
        self.a = a
        self.t0, self.started = time.monotonic(), time.time()
        self.redis = self.state = self.scaler = None
        self.url = self.url_redacted = ""
        try:  # one per cluster unless the environment names one (to call the workers yourself)
            self.secret = cluster_secret.current() or secrets.token_urlsafe(32)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        self.procs: list = []  # the processes now, None while one waits for its restart
        self.slots: list[_Slot] = []  # one per entry of procs
        self.ray_local = a.ray == "local"
        if a.log_dir:  # made when missing, as the processes' own log files are
            try:
                Path(a.log_dir).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise SystemExit(f"error: --log-dir {a.log_dir}: {e.strerror}") from None
        self.kw = {"log_dir": a.log_dir or tempfile.mkdtemp(prefix="baton-up-")}
        self.redis_slot = _Slot("redis-server", self._restart_redis)  # its restarts

    def say(self, msg: str) -> None:
        print(f"[baton up {time.monotonic() - self.t0:5.1f}s] {msg}", flush=True)

    def start(self) -> None:
        a = self.a
        url = self.url = self._start_redis(self._start_ray() if a.ray else a.host)
        # every process gets the URL (a password in it included) and the cluster secret in its
        # environment, never in argv, where `ps` shows them to every user of the host
        self.env = {"BATON_REDIS_URL": url, cluster_secret.ENV: self.secret}
        self.common = ["--dtype", a.dtype, "--kv-cache-dtype", a.kv_cache_dtype]
        self.placement = self._place()
        self.next_slot = a.colocated or a.prefill + a.decode
        threads = a.threads
        if threads is None and not a.ray:
            threads = threads_each(a.colocated or a.prefill + a.decode)
            self.say(f"{threads} torch thread(s) per worker (--threads)")
        for flag, value in (("--model", a.model), ("--num-blocks", a.num_blocks),
                            ("--kv-cache-gb", a.kv_cache_gb), ("--threads", threads)):
            if value is not None:
                self.common += [flag, str(value)]
        self.role = ["--role", "both"] if a.colocated else []
        prefill, decode = self._start_workers()
        router = self._start_router(url)
        self._leave_state()
        # with autoscaling the actuator owns the workers from here on (some come and go; new
        # decode workers meet prefill workers at their first hand-off, not by --peers)
        if a.scaling is not None:
            self.scaler = _autoscaler(a, url, {"prefill": prefill, "decode": decode},
                                      lambda pool: self.spawn(pool, self.common if pool ==
                                                              "prefill" else
                                                              self.common + self.role),
                                      self.say)
            self.procs, self.slots = [router], self.slots[-1:]

    def _place(self) -> list[tuple[str, float]] | None:
        """Which GPU each worker gets (start order: prefill, then decode), or None on CPU."""
        a = self.a
        if a.ray:
            return None  # Ray places the actors (--ray-gpus-per-worker)
        gpus = visible_gpus() if a.device != "cpu" else []
        if a.device.startswith("cuda:"):  # every worker on that one GPU
            want = a.device.split(":", 1)[1]
            if want not in gpus:
                raise SystemExit(f"error: --device {a.device}, but the visible GPUs are "
                                 f"{gpus or 'none'}")
            gpus = [want]
        if a.device.startswith("cuda") and not gpus:
            raise SystemExit("error: --device cuda, but no GPU is visible (CUDA_VISIBLE_DEVICES, "
                             "driver, or a CPU-only build of torch)")
        if not gpus:
            return None
        workers = a.colocated or a.prefill + a.decode
        placement = place_on_gpus(workers, gpus, a.gpu_memory_utilization)
        self.say(f"{len(gpus)} GPU(s) for {workers} worker(s): " + ", ".join(
            f"GPU {g} ({share:.0%} of its memory)" for g, share in placement))
        return placement

    def _gpu(self, i: int) -> tuple[list[str], dict]:
        """Flags and environment of the i-th worker (start order; wraps for later ones)."""
        if self.placement is None:  # no GPU to give: never let auto find one later
            return ["--device", "cpu"], {}
        gpu, share = self.placement[i % len(self.placement)]
        return (["--device", "cuda", "--gpu-memory-utilization", str(share)],
                {"CUDA_VISIBLE_DEVICES": gpu})

    def _add(self, proc, what: str, start: Callable[[], object]) -> None:
        self.procs.append(proc)
        self.slots.append(_Slot(what, start))

    def _leave_state(self) -> None:
        """Where this cluster is, and its restarts, for `baton status`."""
        router = self.procs[len(self.procs) - 1]
        if router is not None:
            restarts = [{"what": s.what, "worker_id": p.worker_id if p else None,
                         "restarts": s.restarts} for p, s in zip(self.procs, self.slots)]
            if self.redis is not None or self.redis_slot.restarts:  # ours, not --redis-url's
                restarts.insert(0, {"what": "redis-server", "worker_id": self.url_redacted,
                                    "restarts": self.redis_slot.restarts})
            self.state = _leave_address(self.url, router, restarts, self.secret, self.started)

    def _start_ray(self) -> str:
        """Ray up (a local instance or a cluster's); the host Redis must listen on."""
        import ray

        a = self.a
        self.say(f"starting Ray ({'a local instance' if self.ray_local else a.ray}) ...")
        try:
            ray.init(address=None if self.ray_local else a.ray, include_dashboard=False,
                     logging_level="WARNING", log_to_driver=False)
        except OSError as e:
            if "AF_UNIX" not in str(e):
                raise
            # Ray keeps a local instance's sockets under $RAY_TMPDIR/ray, else $TMPDIR/ray on
            # Linux: a long TMPDIR (a CI job's, pytest's) passes the 107 bytes a socket's path
            # may have, and Ray's own error names the path but not the way out
            where = "RAY_TMPDIR" if os.environ.get("RAY_TMPDIR") else "TMPDIR"
            raise SystemExit(
                f"error: Ray could not start a local instance: {e}. Its sockets live in a "
                f"folder under ${where} ({os.environ.get(where)}): set RAY_TMPDIR to a short "
                "folder (RAY_TMPDIR=/tmp) and run baton up again") from None
        res = ray.cluster_resources()
        self.say(f"Ray: {res.get('CPU', 0):.0f} CPUs, {res.get('GPU', 0):.0f} GPUs")
        self.ray_gpus = a.ray_gpus_per_worker
        if self.ray_gpus is None:
            self.ray_gpus = 1.0 if a.device.startswith("cuda") or (
                a.device == "auto" and res.get("GPU", 0) > 0) else 0.0
        if self.ray_gpus:
            self.say(f"each worker actor asks Ray for {self.ray_gpus:g} GPU(s) and runs on them")
        # workers on other nodes must reach Redis
        return a.host if self.ray_local else ray.util.get_node_ip_address()

    def _start_redis(self, host: str) -> str:
        from baton.control.cluster_state import state_file
        from baton.control.redis_server import EmbeddedRedis
        from baton.services.common.process import is_loopback

        if self.a.redis_url is not None:
            self.url_redacted = redact(self.a.redis_url)
            return self.a.redis_url
        # listening beyond loopback, the registry (where routers find workers) needs a
        # password: one per cluster, in the URL the processes get in their environment
        password = None if is_loopback(host) else secrets.token_urlsafe(24)
        self.redis = EmbeddedRedis(host, password=password, die_with_parent=True).start()
        self.url_redacted = redact(self.redis.url)
        self.say(f"redis-server on {self.url_redacted}" + (
            " (password generated; the whole URL, for workers started elsewhere, is in "
            f"{state_file()}, readable by this user only)"
            if password else ""))
        return self.redis.url

    def _restart_redis(self):
        """The embedded redis-server again, on the same address (and password): workers and
        routers keep their URL, re-register within a heartbeat and republish what they hold."""
        from baton.control.redis_server import EmbeddedRedis

        old = self.redis
        old.stop()  # it exited: this removes its directory
        self.redis = EmbeddedRedis(old.host, old.port, old.password, die_with_parent=True).start()
        return self.redis

    def _supervise_redis(self, stop: threading.Event) -> None:
        """Start the embedded redis-server again if it exited (backoff as for the workers)."""
        r, s = self.redis, self.redis_slot
        if r is None or stop.is_set():
            return
        now = time.monotonic()
        if s.due is None and r.proc is not None and r.proc.poll() is not None:
            s.restarts += 1
            s.due = now + min(s.backoff(), 2.0)  # everything waits on it: retry soon
            self.say(f"redis-server exited ({r.proc.returncode}); starting it again on "
                     f"{self.url_redacted} (restart {s.restarts}); workers and routers "
                     "re-register and republish when it answers")
        elif s.due is not None and now >= s.due:
            try:
                s.start()
            except Exception as e:  # RedisStartError, a port taken meanwhile: try again
                s.due = time.monotonic() + 2.0
                self.say(f"redis-server did not start ({e}); trying again in 2s")
                return
            s.due = None
            self.say(f"redis-server back on {self.url_redacted} (restart {s.restarts}), empty")
            self._leave_state()

    def spawn(self, role: str, args: list[str], slot: int | None = None):
        """Start a ``role`` worker; ``slot``: its place in start order, which picks its GPU
        (None: the next one, for workers the autoscaler adds)."""
        from baton.services.launch.local import WorkerProcess

        a = self.a
        if slot is None:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        args = [*args, *self._tier_args(slot)]
        tp = a.prefill_tp if role == "prefill" else a.decode_tp
        if not a.ray:
            device, env = self._gpu(slot)
            if tp > 1:  # every rank on the worker's one device (named: ranks share a pool)
                device = [d if d != "cuda" else "cuda:0" for d in device]
                args += ["--tensor-parallel-size", str(tp)]
            return WorkerProcess(role, ["--host", a.host, *device, *args],
                                 env={**self.env, **env}, die_with_parent=True, **self.kw)
        from baton.services.launch.ray_actors import RayWorker

        gpus = self.ray_gpus
        device = ["--device", "cuda" if gpus else "cpu"]
        w = RayWorker(role, device + args, env=self.env,
                      num_cpus=a.ray_cpus_per_worker or a.threads or 1, num_gpus=gpus,
                      local=self.ray_local, **self.kw)
        self.say(f"Ray actor for a {role} worker on node {w.node_ip} ({w.start_s:.0f}s)")
        return w

    def _tier_args(self, slot: int) -> list[str]:
        """The KV tier flags of the worker in start slot ``slot`` (its own disk directory, the
        same for every restart of that slot)."""
        a, out = self.a, []
        if a.kv_host_tier_gb is not None:
            out += ["--kv-host-tier-gb", str(a.kv_host_tier_gb)]
        if a.kv_disk_tier_gb:
            from baton import cache_dir

            out += ["--kv-disk-tier-gb", str(a.kv_disk_tier_gb), "--kv-disk-tier-dir",
                    str(cache_dir() / "kv-tier" / f"up-{a.grpc_port}-{slot}")]
        return out

    def _start_workers(self) -> tuple[list, list]:
        a = self.a
        prefill = [] if a.colocated else [self.spawn("prefill", self.common, i)
                                          for i in range(a.prefill)]
        for i, w in enumerate(prefill):
            self._add(w, "prefill worker", lambda i=i: self.spawn("prefill", self.common, i))
            self.say(f"prefill worker {w.worker_id} on {w.address}")
        peers = ",".join(w.address for w in prefill)
        decode_args = self.common + self.role + (["--peers", peers] if peers else [])
        what = "colocated worker" if a.colocated else "decode worker"
        decode = []
        for j in range(a.colocated or a.decode):
            slot = len(prefill) + j
            decode.append(self.spawn("decode", decode_args, slot))
            # started again, it meets the prefill workers at its first hand-off (those in
            # --peers may have been restarted elsewhere meanwhile)
            self._add(decode[-1], what,
                      lambda slot=slot: self.spawn("decode", self.common + self.role, slot))
            self.say(f"{what} {decode[-1].worker_id} on {decode[-1].address}")
        return prefill, decode

    def _start_router(self, url: str):
        from baton.services.launch.local import WorkerProcess

        a = self.a
        local_max = 1 << 30 if a.colocated else a.local_prefill_max_tokens
        security = []  # file paths; the token itself goes in the environment
        for flag, value in (("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key),
                            ("--api-keys-file", a.api_keys_file)):
            if value:
                security += [flag, value]
        args = ["--host", a.host, "--port", str(a.grpc_port), "--http-port", str(a.http_port),
                "--local-prefill-max-tokens", str(local_max), "--routing", a.routing,
                *security, *shlex.split(a.router_args)]
        env = {**self.env, **({"BATON_AUTH_TOKEN": a.auth_token} if a.auth_token else {})}
        kw = {**self.kw, "die_with_parent": True}
        router = WorkerProcess("router", args, env=env, **kw)
        self._add(router, "router", lambda: WorkerProcess("router", args, env=env, **kw))
        self.say(f"ready: gRPC API (baton.v1.Baton) on {router.address}; logs in "
                 f"{self.procs[0].log_path.parent}")
        if router.http_address:
            self.say(f"ready: OpenAI-compatible API on http{'s' if a.tls_cert else ''}://"
                     f"{router.http_address}/v1")
        print(f"  try: baton request \"Hello\" --router {router.address}", flush=True)
        print("       baton status   (or baton top)", flush=True)
        return router

    def watch(self, stop: threading.Event) -> int:
        """Supervise until Ctrl-C (then 0)."""
        if self.scaler is not None:
            threading.Thread(target=self.scaler.run, args=(stop,), daemon=True).start()
        while not stop.is_set():
            self._supervise(stop)
            stop.wait(0.5)
        self.say("stopping")
        return 0

    def _supervise(self, stop: threading.Event) -> None:
        """Note the processes that exited and start again those whose backoff is over."""
        self._supervise_redis(stop)
        now = time.monotonic()
        for i, (p, s) in enumerate(zip(self.procs, self.slots)):
            if p is not None and p.proc.poll() is not None:
                s.restarts += 1
                s.due = now + s.backoff()
                self.say(f"{s.what} {p.worker_id} exited ({p.proc.returncode}); starting it "
                         f"again in {s.backoff():g}s (restart {s.restarts}); its log: "
                         f"{p.log_path}")
                p.stop(timeout=1.0)  # it has exited: this closes its channel and log
                self.procs[i] = None
                self._leave_state()
            elif p is None and s.due is not None and now >= s.due and not stop.is_set():
                self._restart(i, s)
        if self.scaler is not None:  # the autoscaler replaces what its pools lost
            for w in self.scaler.actuator.all():
                if w.proc.poll() is not None:
                    self.say(f"{w.role} worker {w.worker_id} exited ({w.proc.returncode}); "
                             f"the autoscaler replaces it. Its log: {w.log_path}")
                    self.scaler.actuator.forget(w)

    def _restart(self, i: int, s: _Slot) -> None:
        try:
            p = self.procs[i] = s.start()
        except Exception as e:  # WorkerStartError, or Ray's: try again after a longer wait
            s.restarts += 1
            s.due = time.monotonic() + s.backoff()
            first = (str(e).splitlines() or [type(e).__name__])[0]
            self.say(f"{s.what} did not start ({first}); trying again in {s.backoff():g}s")
            return
        s.due = None
        self.say(f"{s.what} back: {p.worker_id} on {p.address} (restart {s.restarts})")
        self._leave_state()

    def stop(self) -> None:
        if self.state is not None:  # this process's own file
            self.state.unlink(missing_ok=True)
        procs = [p for p in self.procs if p is not None]
        if self.scaler is not None:
            self.scaler.actuator.wait(60)  # starts in progress end first: none is left behind
            procs = [*self.scaler.actuator.all(), *procs]
        for p in reversed(procs):  # router first, then decode, then prefill: each drains
            p.stop(timeout=40)
        if self.redis is not None:
            self.redis.stop()
        if self.a.ray:
            import ray

            ray.shutdown()
        if procs or self.redis:
            self.say("stopped")


def _leave_address(redis_url: str, router, restarts: list | None = None, secret: str = "",
                   started: float = 0.0):
    """Write where this cluster is for `baton status` / `baton top`, and its cluster secret for
    `baton role` / `baton tune --live --apply` (this process's file, removed at exit; its
    user's only)."""
    from baton.control.cluster_state import process_start, state_file

    path = state_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)  # the Redis URL may hold a password: this user's only
        path.chmod(0o600)
        path.write_text(json.dumps({"pid": os.getpid(),
                                    "process_start": process_start(os.getpid()),
                                    "started": started,
                                    "redis_url": redis_url, "router": router.address,
                                    "http": router.http_address,
                                    "restarts": restarts or [], "secret": secret}))
    except OSError:
        return None
    return path


def _autoscaler(a: UpConfig, redis_url: str, workers: dict, spawn, say):
    """The policy on the routers' metrics, acting on this process's workers."""
    from baton.control.autoscale import (
        Autoscaler,
        MetricsSignals,
        Policy,
        ProcessActuator,
    )

    pols, sc = a.policies(), a.scaling
    assert sc is not None
    actuator = ProcessActuator(spawn, workers, drain_timeout=40.0)

    def announce(d) -> None:
        say(f"autoscale: {d.pool} pool {d.current} -> {d.desired} ({d.reason})")

    say("autoscaling " + ", ".join(f"{p} {pol.min_replicas}..{pol.max_replicas}"
                                   for p, pol in pols.items())
        + f" on TTFT <= {sc.slo.ttft_s:g}s, TPOT <= {sc.slo.tpot_s * 1000:g}ms")
    return Autoscaler(Policy(pols, sc.slo), actuator, MetricsSignals(redis_url, sc.window_s),
                      sc.interval_s, on_change=announce)
