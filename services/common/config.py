"""A worker process's configuration: frozen settings built once from its command line, in layers
(engine -> server -> the role's own), each flag declared once. Below ``main`` nothing sees an
``argparse.Namespace``; ``from_args`` raises ValueError naming the flag that is wrong.

    WorkerConfig
      role           prefill | decode | both
      engine         EngineSettings   --model --dtype --device --gpu-memory-utilization
                                      --num-blocks --block-size --max-num-seqs --kv-staging ...
      server         ServerSettings   --host --port --advertise-* --redis-url --metrics-port ...
      holder         HolderSettings   --lease-ttl --max-leased-share --kv-checksums (prefill, both)
      transfer_timeout, peers         --transfer-timeout --peers (decode, both)
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from baton.engine.families import MODEL_HELP
from baton.services.common import faults

# the engine's dtypes: one declaration for the worker's flag and baton up's
DTYPES = ["float32", "bfloat16", "float16"]

# a CPU worker's KV pool without --num-blocks: --kv-cache-gb, else this variable, else 1 GiB
KV_CACHE_GB_ENV = "BATON_KV_CACHE_GB"
DEFAULT_KV_CACHE_GB = 1.0


def kv_cache_gb(given: float | None, num_blocks: int | None = None) -> float:
    """A CPU pool's GiB: ``given`` (--kv-cache-gb), else ``$BATON_KV_CACHE_GB``, else
    :data:`DEFAULT_KV_CACHE_GB`. Raises ValueError naming the flag or the variable when it is
    not a positive number, and when --kv-cache-gb is given beside ``num_blocks``
    (--num-blocks)."""
    if given is not None:
        if num_blocks is not None:
            raise ValueError("--kv-cache-gb and --num-blocks both size the KV pool: give one")
        name, value = "--kv-cache-gb", given
    elif os.environ.get(KV_CACHE_GB_ENV):
        name, raw = f"${KV_CACHE_GB_ENV}", os.environ[KV_CACHE_GB_ENV]
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: a KV pool size in GiB is a number") from None
    else:
        return DEFAULT_KV_CACHE_GB
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} {value:g}: a KV pool size in GiB is a positive number")
    return value


@dataclass(frozen=True)
class EngineSettings:
    model: str | None  # GGUF file or HF folder; None: the default model
    dtype: str
    num_blocks: int | None  # None: kv_cache_gb's worth on CPU, the device's share on a GPU
    block_size: int
    max_num_seqs: int
    threads: int | None  # torch threads; None: torch's default
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    gpu_memory_utilization: float = 0.9
    kv_staging: str = "auto"  # auto | always | never (baton.transfer.agent.STAGING)
    kv_host_tier_gb: float | None = None  # None: 4 GiB under a GPU pool, none under a CPU pool
    kv_disk_tier_gb: float = 0.0
    kv_disk_tier_dir: str | None = None  # None: <cache dir>/kv-tier/<worker name>
    kv_cache_dtype: str = "auto"  # auto (the --dtype) | fp8 (GPU)
    tensor_parallel_size: int = 1  # ranks of this worker's group (engine/tp.py)
    kv_layout: str = "head"  # head | block (engine/kv_layout.py)
    kv_cache_gb: float | None = None  # a CPU pool's GiB without --num-blocks; None: the default

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device {self.device}: must be auto, cpu, cuda or cuda:N")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: must be "
                             "in (0, 1]")
        if self.kv_host_tier_gb is not None and self.kv_host_tier_gb < 0:
            raise ValueError(f"--kv-host-tier-gb {self.kv_host_tier_gb}: must be >= 0")
        if self.kv_disk_tier_gb < 0:
            raise ValueError(f"--kv-disk-tier-gb {self.kv_disk_tier_gb}: must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: must be >= 1")
        if self.tensor_parallel_size > 1 and self.kv_layout == "block":
            raise ValueError("--kv-layout block holds one rank's KV heads; "
                             f"--tensor-parallel-size {self.tensor_parallel_size} needs "
                             "--kv-layout head")

    @staticmethod
    def add_flags(ap: argparse.ArgumentParser) -> None:
        g = ap.add_argument_group("engine")
        g.add_argument("--model", default=None, help=MODEL_HELP)
        g.add_argument("--dtype", default="float32", choices=DTYPES)
        g.add_argument("--device", default=os.environ.get("BATON_DEVICE", "auto"),
                       help="where the engine and its KV pool live: cpu, cuda (the first GPU "
                            "this process sees), cuda:N, or auto: cuda when a GPU is visible, "
                            "else cpu (default $BATON_DEVICE, else auto)")
        g.add_argument("--gpu-memory-utilization", type=float,
                       default=float(os.environ.get("BATON_GPU_MEMORY_UTILIZATION", "0.9")),
                       help="on a GPU: the share of its memory this worker may use in all "
                            "(weights, activations, CUDA graphs, KV pool); the KV pool gets "
                            "what is left, logged at start-up. Workers sharing a GPU each need "
                            "their own share: two at 0.45 (default "
                            "$BATON_GPU_MEMORY_UTILIZATION, else 0.9)")
        g.add_argument("--num-blocks", type=int, default=None,
                       help="KV-cache blocks in the pool (default: --kv-cache-gb worth on CPU; "
                            "on a GPU what --gpu-memory-utilization leaves)")
        g.add_argument("--kv-cache-gb", type=float, default=None,
                       help="a CPU worker's KV pool in GiB, when --num-blocks is not given: "
                            "host memory the worker zero-fills as it starts (default "
                            f"${KV_CACHE_GB_ENV}, else {DEFAULT_KV_CACHE_GB:g}). A GPU pool is "
                            "sized by --gpu-memory-utilization: there it is refused")
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--max-num-seqs", type=int, default=64)
        g.add_argument("--threads", type=int, default=None,
                       help="torch threads (default: torch's)")
        g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                       help="the KV cache's element type: auto (the --dtype) or fp8 (e4m3 with "
                            "per-layer scales, the checkpoint's where it has them, else 1: half "
                            "a bf16 cache's bytes, so twice the blocks; GPU only). Part of the "
                            "model fingerprint: prefill and decode pools must agree, a worker "
                            "of the other kind is refused naming both (default auto)")
        g.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                       help="ranks of this worker's tensor-parallel group: N processes, each "
                            "loading 1/N of every weight (heads, MLP, vocabulary), one "
                            "all-reduce per attention and MLP block (gloo on CPU, one torch "
                            "thread per rank). Rank 0 serves gRPC and schedules; all ranks "
                            "share one KV pool, so one lease covers the group. Not part of the "
                            "fingerprint: a prefill group of any size hands off to a decode "
                            "group of any size whose KV heads map (docs/tensor-parallel.md; "
                            "default 1)")
        g.add_argument("--kv-layout", default="head", choices=["head", "block"],
                       help="the KV pool's layout: head (KV-head-major: each rank's heads "
                            "contiguous; hands off to and from any tensor-parallel size) or "
                            "block (block-major: one descriptor per run of blocks, the fewest, "
                            "but one rank only and only to and from other block-major pools; "
                            "a pair that cannot map is refused naming both layouts). Default "
                            "head")
        g.add_argument("--kv-staging", default="auto", choices=["auto", "always", "never"],
                       help="hand-offs of a GPU pool: auto reads VRAM to VRAM over NIXL and "
                            "stages through a pinned host copy of the pool only where NIXL "
                            "cannot register the VRAM (logged, and shown as staged-host in "
                            "transports, worker info and /metrics); always stages every "
                            "hand-off; never refuses to start instead of staging (default auto)")
        EngineSettings.add_tier_flags(ap)

    @staticmethod
    def add_tier_flags(ap: argparse.ArgumentParser) -> None:
        t = ap.add_argument_group(
            "KV tiers", "Prefix blocks the KV pool evicts are kept in slower tiers and loaded "
            "back on a prefix hit instead of being recomputed: host memory under a GPU pool, "
            "then local disk. The router's index knows each block's tier.")
        t.add_argument("--kv-host-tier-gb", type=float, default=None,
                       help="pinned host memory for blocks a GPU pool evicts (default 4; 0 "
                            "turns it off). A CPU pool is host memory already: give it the "
                            "memory instead (--kv-cache-gb) and use the disk tier")
        t.add_argument("--kv-disk-tier-gb", type=float, default=0.0,
                       help="local disk for evicted blocks, one preallocated file with a "
                            "checksum per block (default 0: off). A full disk or an I/O error "
                            "turns the tier off (logged, baton_kv_tier_errors_total), never a "
                            "request")
        t.add_argument("--kv-disk-tier-dir", default=None,
                       help="the disk tier's directory; a restarted worker revalidates the file "
                            "it finds there (same model fingerprint, every block's checksum) or "
                            "discards it, and logs which (default: $BATON_CACHE_DIR or "
                            "~/.cache/baton, then kv-tier/<--worker-id, else role-port>; give "
                            "--worker-id or a fixed --port so a restart finds the same one)")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> EngineSettings:
        return cls(a.model, a.dtype, a.num_blocks, a.block_size, a.max_num_seqs, a.threads,
                   a.device, a.gpu_memory_utilization, a.kv_staging, a.kv_host_tier_gb,
                   a.kv_disk_tier_gb, a.kv_disk_tier_dir, a.kv_cache_dtype,
                   a.tensor_parallel_size, a.kv_layout, a.kv_cache_gb)

    def resolved_device(self) -> str:
        """``--device`` with auto decided: cuda when this process sees a GPU, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def engine_config(self, record_kv_events: bool, worker_name: str | None = None):
        """The engine's own config (``baton.engine.config.EngineConfig``); ``worker_name`` names
        the default disk-tier directory (None: there is no stable name to give it). Raises
        ValueError for a host tier under a CPU pool, or a disk tier without a directory."""
        from baton.engine.config import EngineConfig

        device = self.resolved_device()
        host_gb = self.kv_host_tier_gb
        if device == "cpu" and host_gb:
            raise ValueError(f"--kv-host-tier-gb {host_gb}: a CPU worker's KV pool is host "
                             "memory already; give the pool that memory (--kv-cache-gb) and use "
                             "--kv-disk-tier-gb for the tier below it")
        if device != "cpu" and self.kv_cache_gb is not None:
            raise ValueError(f"--kv-cache-gb {self.kv_cache_gb:g} sizes a CPU worker's KV pool; "
                             f"on {device} the pool is what --gpu-memory-utilization leaves "
                             "(or give --num-blocks)")
        cpu_pool = {}  # the flag given (refused beside --num-blocks), or a CPU pool's default
        if self.kv_cache_gb is not None or (device == "cpu" and self.num_blocks is None):
            gb = kv_cache_gb(self.kv_cache_gb, self.num_blocks)
            cpu_pool["kv_cache_bytes"] = int(gb * (1 << 30))
        if device == "cpu" and self.kv_cache_dtype == "fp8":
            raise ValueError("--kv-cache-dtype fp8: an FP8 KV cache is read by the Triton "
                             "attention kernels and needs a GPU (--device cuda); the CPU "
                             "kernels read float32 or bfloat16 KV")
        if host_gb is None:
            host_gb = 4.0 if device != "cpu" else 0.0
        disk_dir = self.kv_disk_tier_dir
        if self.kv_disk_tier_gb and disk_dir is None:
            if worker_name is None:
                raise ValueError("--kv-disk-tier-gb needs a directory a restarted worker finds "
                                 "again: give --kv-disk-tier-dir, --worker-id or a fixed --port")
            root = os.environ.get("BATON_CACHE_DIR") or os.path.expanduser("~/.cache/baton")
            disk_dir = os.path.join(root, "kv-tier", worker_name)
        return EngineConfig(dtype=self.dtype, device=device,
                            block_size=self.block_size, num_kv_blocks=self.num_blocks,
                            max_num_seqs=self.max_num_seqs, num_threads=self.threads,
                            record_kv_events=record_kv_events,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            kv_host_tier_bytes=int(host_gb * (1 << 30)),
                            kv_disk_tier_bytes=int(self.kv_disk_tier_gb * (1 << 30)),
                            kv_disk_tier_dir=disk_dir, kv_cache_dtype=self.kv_cache_dtype,
                            tensor_parallel_size=self.tensor_parallel_size,
                            kv_layout=self.kv_layout, **cpu_pool)


@dataclass(frozen=True)
class ServerSettings:
    host: str
    advertise_host: str | None
    port: int
    advertise_port: int  # 0: the bound port
    worker_id: str | None  # None: role-host-port
    log_level: str
    redis_url: str | None  # None: not registered
    metrics_port: int  # 0: a free one, -1: none
    registry_ttl: float
    drain_timeout: float

    @staticmethod
    def add_flags(ap: argparse.ArgumentParser) -> None:
        g = ap.add_argument_group("server")
        g.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (0.0.0.0: every interface)")
        g.add_argument("--advertise-host", default=os.environ.get("BATON_ADVERTISE_HOST"),
                       help="address routers and peers reach this worker at, registered in "
                            "Redis (default $BATON_ADVERTISE_HOST, else --host, else this host's "
                            "IP when --host is 0.0.0.0; in Kubernetes: the pod IP)")
        g.add_argument("--port", type=int, default=0, help="gRPC port (0: pick a free one)")
        g.add_argument("--advertise-port", type=int, default=0,
                       help="gRPC port routers and peers reach this worker at, when a proxy or a "
                            "port mapping sits in front of --port (default: --port)")
        g.add_argument("--worker-id", default=None, help="stable name (default: role-host-port)")
        g.add_argument("--log-level", default="INFO")
        g.add_argument("--redis-url", default=os.environ.get("BATON_REDIS_URL"),
                       help="register in this Redis (worker registry, TTL heartbeat); "
                            "e.g. redis://127.0.0.1:6379/0, redis://:PASSWORD@host:6379/0, "
                            "rediss://... (TLS) (default $BATON_REDIS_URL, which keeps a "
                            "password off the command line). Without it the worker is not "
                            "discoverable")
        g.add_argument("--metrics-port", type=int, default=0,
                       help="Prometheus /metrics port (0: a free one, printed as BATON_METRICS; "
                            "-1: none)")
        g.add_argument("--registry-ttl", type=float, default=10.0,
                       help="seconds a registry entry outlives its last heartbeat (default 10)")
        g.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM: seconds to finish in-flight requests after "
                            "deregistering and refusing new ones (default 30)")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> ServerSettings:
        return cls(a.host, a.advertise_host, a.port, a.advertise_port, a.worker_id,
                   a.log_level, a.redis_url, a.metrics_port, a.registry_ttl, a.drain_timeout)


@dataclass(frozen=True)
class HolderSettings:
    """The prefill role's KV holder: leases over the blocks decode workers read."""

    lease_ttl: float = 30.0
    max_leased_share: float = 0.0  # 0: never refuse
    kv_checksums: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.max_leased_share <= 1:
            raise ValueError(f"--max-leased-share {self.max_leased_share}: must be in [0, 1]")
        if self.lease_ttl <= 0:
            raise ValueError(f"--lease-ttl {self.lease_ttl}: must be > 0")

    @staticmethod
    def add_flags(g, full: bool) -> None:
        """``--lease-ttl``; with ``full`` (a prefill worker) the backpressure and checksums."""
        g.add_argument("--lease-ttl", type=float, default=30.0,
                       help="seconds a prefilled request's blocks stay pinned for a reader "
                            "(default 30); an expired lease frees them and its reader is refused")
        if not full:
            return
        g.add_argument("--max-leased-share", type=float, default=0.5,
                       help="refuse new prompts (RESOURCE_EXHAUSTED; the router tries another "
                            "worker or prefills locally) while this share of the KV pool waits "
                            "under leases for decode workers to read it (0: never) "
                            "(default 0.5)")
        g.add_argument("--kv-checksums", action="store_true",
                       help="send per-block CRC32s in each handle for readers to verify "
                            "(debugging)")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> HolderSettings:
        return cls(a.lease_ttl, getattr(a, "max_leased_share", 0.0),
                   getattr(a, "kv_checksums", False))


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # prefill | decode | both
    engine: EngineSettings
    server: ServerSettings
    holder: HolderSettings | None = None  # prefill and both
    transfer_timeout: float = 10.0  # decode and both: one hand-off's deadline
    peers: tuple[str, ...] = ()  # decode and both: prefill workers to handshake with first

    @classmethod
    def prefill(cls, a: argparse.Namespace) -> WorkerConfig:
        return cls("prefill", EngineSettings.from_args(a), ServerSettings.from_args(a),
                   HolderSettings.from_args(a))

    @classmethod
    def decode(cls, a: argparse.Namespace) -> WorkerConfig:
        if a.transfer_timeout <= 0:
            raise ValueError(f"--transfer-timeout {a.transfer_timeout}: must be > 0")
        return cls(a.role, EngineSettings.from_args(a), ServerSettings.from_args(a),
                   HolderSettings.from_args(a) if a.role == "both" else None,
                   a.transfer_timeout, tuple(p for p in a.peers.split(",") if p))


def worker_parser(prog: str, description: str) -> tuple[argparse.ArgumentParser, object]:
    """A worker's parser with the engine and server flags; returns it and its "KV hand-off"
    group for the role's own flags."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    EngineSettings.add_flags(ap)
    ServerSettings.add_flags(ap)
    faults.add_flag(ap)  # tests only, hidden
    return ap, ap.add_argument_group("KV hand-off")
