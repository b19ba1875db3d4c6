"""Tensor parallelism inside one engine: a group of ranks, one process each.

Rank 0 is the engine everyone talks to (scheduler, block table, sampling, KV tiers, NIXL agent);
ranks 1..N-1 are follower processes (``python -m baton.engine.tp``) that rank 0 starts, each
loading only its shard of the weights. Every step, rank 0 sends its step plan (the batch's token
ids, positions, block ids and attention metadata as host lists) to every follower over a local
pipe; each rank then runs the same forward on its shard:

* attention: rank ``r`` has query heads ``[r * Hq / N, (r + 1) * Hq / N)`` and the KV heads they
  use (a replica where there are fewer KV heads than ranks); qkv is column-parallel, o
  row-parallel: one all-reduce after o.
* MLP: gate/up column-parallel, down row-parallel (each expert's intermediate dimension, for a
  mixture of experts): one all-reduce after it.
* embedding and LM head vocab-parallel: rank ``r`` holds vocabulary rows ``[r * V', ...)``
  (``V' = ceil(V / N)``); the embedding is one all-reduce, the logits one all-gather.

The KV pool is one KV-head-major region (``engine/kv_layout.py``) shared by the group: on CPU a
``/dev/shm`` file every rank maps; on one CUDA device a CUDA IPC handle. Each rank computes into
its own slots; rank 0 reads and writes every slot (KV tiers, NIXL hand-offs, checksums), so one
lease and one block table cover the group.

Failure is whole: every collective has ``tp_timeout_s``; a follower exits when rank 0's pipe
closes, and rank 0's next step fails (:class:`TPGroupError`) when a follower has exited or a
collective fails, which ends the worker (it deregisters; the router retries or migrates its
requests elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import mmap
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.distributed as dist
import torch.nn.functional as F
from baton.engine.config import EngineConfig, ModelConfig
from baton.engine.errors import BatonError, UnsupportedModelError

log = logging.getLogger("baton.engine.tp")


class TPGroupError(BatonError):
    """A rank of a tensor-parallel group died or a collective failed: the group is down."""


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int


# =================================================================================================
# Which rows and columns each rank keeps
# =================================================================================================


def check_model(cfg: ModelConfig, size: int) -> None:
    """Refuse (naming the field) a model whose heads or MLP do not split over ``size`` ranks."""
    def need(field: str, value: int, why: str) -> None:
        raise UnsupportedModelError(f"config field {field}={value} {why} at tensor-parallel size "
                                    f"{size}; choose a size that divides it")

    if size == 1:
        return
    if cfg.num_heads % size:
        need("num_attention_heads", cfg.num_heads, "does not split")
    h = cfg.num_kv_heads
    if (h % size if h >= size else size % h):
        need("num_key_value_heads", h, "neither divides nor is divided by the ranks")
    if any(not cfg.is_moe(i) for i in range(cfg.num_layers)) and cfg.intermediate_size % size:
        need("intermediate_size", cfg.intermediate_size, "does not split")
    if cfg.moe_layers and cfg.moe_intermediate_size % size:
        need("moe_intermediate_size", cfg.moe_intermediate_size, "does not split")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """What one rank computes: its query and KV heads, its share of the MLP."""
    if size == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size)


def vocab_range(vocab: int, shard: TPShard) -> tuple[int, int]:
    per = -(-vocab // shard.size)
    return min(vocab, shard.rank * per), min(vocab, (shard.rank + 1) * per)


def kv_heads_of(cfg: ModelConfig, shard: TPShard) -> list[int]:
    h, n = cfg.num_kv_heads, shard.size
    if h >= n:
        return list(range(shard.rank * h // n, (shard.rank + 1) * h // n))
    return [shard.rank * h // n]


Rule = tuple[str, list[tuple[int, int]]]  # ("rows" | "cols", kept half-open ranges)


def kept(name: str, cfg: ModelConfig, shard: TPShard) -> Rule | None:
    """The part of fused weight ``name`` (``loader._layout``'s names) rank ``shard.rank``
    keeps: row ranges (column-parallel, and vocab rows) or one column range (row-parallel);
    None: every rank keeps all of it."""
    if shard.size == 1:
        return None
    kind = name.rsplit(".", 1)[-1]
    d, n, r = cfg.head_dim, shard.size, shard.rank
    hq = cfg.num_heads // n
    q_cols = (r * hq * d, (r + 1) * hq * d)
    if kind in ("qkv", "qkv_bias"):
        k0, v0 = cfg.q_size, cfg.q_size + cfg.kv_size
        heads = kv_heads_of(cfg, shard)
        return "rows", [q_cols, *[(k0 + h * d, k0 + (h + 1) * d) for h in heads],
                        *[(v0 + h * d, v0 + (h + 1) * d) for h in heads]]
    if kind == "o":
        return "cols", [q_cols]
    if kind in ("gate_up", "down"):
        i = cfg.intermediate_size
        il = i // n
        if kind == "down":
            return "cols", [(r * il, (r + 1) * il)]
        return "rows", [(r * il, (r + 1) * il), (i + r * il, i + (r + 1) * il)]
    if kind in ("experts_gate_up", "experts_down"):
        i = cfg.moe_intermediate_size
        il = i // n
        if kind == "experts_down":
            return "cols", [(r * il, (r + 1) * il)]
        return "rows", [(e * 2 * i + a, e * 2 * i + b) for e in range(cfg.num_experts)
                        for a, b in ((r * il, (r + 1) * il), (i + r * il, i + (r + 1) * il))]
    if kind in ("embed", "lm_head") and "." not in name:
        return "rows", [vocab_range(cfg.vocab_size, shard)]
    return None


def kept_shape(shape: tuple[int, ...], rule: Rule | None) -> tuple[int, ...]:
    if rule is None:
        return shape
    n = sum(b - a for a, b in rule[1])
    return (n, *shape[1:]) if rule[0] == "rows" else (shape[0], n, *shape[2:])


def take(t: torch.Tensor, rule: Rule | None) -> torch.Tensor:
    """``t`` cut to ``rule`` (a copy; ``t`` itself when the rank keeps all)."""
    if rule is None:
        return t
    if rule[0] == "cols":
        a, b = rule[1][0]
        return t[:, a:b].contiguous()
    return torch.cat([t[a:b] for a, b in rule[1]])


def rows_into(rule: Rule, first: int, end: int) -> list[tuple[int, int, int]]:
    """For a source filling fused rows ``[first, end)``: (source row, kept row, count) of each
    piece of it the rank keeps."""
    out, at = [], 0
    for a, b in rule[1]:
        lo, hi = max(a, first), min(b, end)
        if lo < hi:
            out.append((lo - first, at + lo - a, hi - lo))
        at += b - a
    return out


# =================================================================================================
# Collectives (every rank)
# =================================================================================================


class TPComm:
    """The model's collectives for one rank: in-place all-reduce of a row-parallel output,
    the vocab-parallel embedding and the all-gathered logits."""

    def __init__(self, shard: TPShard, vocab: int) -> None:
        self.shard = shard
        self.vocab = vocab
        self.v0, self.v1 = vocab_range(vocab, shard)
        self.per = -(-vocab // shard.size)

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the group, in place. gloo moves host memory: a CUDA tensor goes
        through the host (the ranks of a group share one GPU here; NCCL between GPUs is not
        built)."""
        if t.device.type == "cpu":
            dist.all_reduce(t)
            return t
        host = t.cpu()
        dist.all_reduce(host)
        return t.copy_(host)

    def embed_rows(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """This rank's embedding rows of ``ids`` (zero where another rank holds the row)."""
        inside = (ids >= self.v0) & (ids < self.v1)
        h = F.embedding((ids - self.v0).clamp_(0, max(0, self.v1 - self.v0 - 1)), table)
        return h * inside[:, None].to(h.dtype)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[N, own vocab rows] on every rank -> [N, vocab] (rows padded to equal shares)."""
        pad = self.per - local.shape[1]
        if pad:
            local = F.pad(local, (0, pad))
        host = local.contiguous().cpu()
        parts = [torch.empty_like(host) for _ in range(self.shard.size)]
        dist.all_gather(parts, host)
        return torch.cat(parts, dim=1)[:, : self.vocab].to(local.device)


# =================================================================================================
# The shared KV pool
# =================================================================================================


def shared_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str
                ) -> tuple[torch.Tensor, dict]:
    """A zeroed pool every rank of the group can map, and how a follower maps it."""
    count = math.prod(shape)
    if device != "cpu":
        from torch.multiprocessing.reductions import reduce_tensor

        t = torch.zeros(shape, dtype=dtype, device=device)
        return t, {"cuda": reduce_tensor(t)}
    nbytes = max(1, count * dtype.itemsize)
    fd, path = tempfile.mkstemp(prefix="baton-kv-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                else None)
    try:
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    t = torch.frombuffer(region, dtype=dtype, count=count).view(shape)
    t.zero_()  # commit the pages now, as the private pool does
    return t, {"path": path, "shape": shape, "dtype": str(dtype).removeprefix("torch.")}


def map_pool(spec: dict) -> torch.Tensor:
    if "cuda" in spec:
        fn, args = spec["cuda"]
        return fn(*args)
    dtype = getattr(torch, spec["dtype"])
    count = math.prod(spec["shape"])
    with open(spec["path"], "r+b") as f:
        region = mmap.mmap(f.fileno(), max(1, count * dtype.itemsize), flags=mmap.MAP_SHARED)
    return torch.frombuffer(region, dtype=dtype, count=count).view(spec["shape"])


# =================================================================================================
# Rank 0: the group
# =================================================================================================


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """Rank 0's handle on its followers: starts them, sends each step plan, notices a death."""

    def __init__(self, model_path: str, cfg: EngineConfig) -> None:
        self.size, self.timeout = cfg.tensor_parallel_size, cfg.tp_timeout_s
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        init = f"tcp://127.0.0.1:{_free_port()}"
        env = {**os.environ, "BATON_TP_KEY": key.hex()}
        spec = json.dumps({"model": model_path, "cfg": dataclasses.asdict(cfg), "init": init,
                           "plan": list(self._listener.address)})
        self.procs = [subprocess.Popen([sys.executable, "-m", "baton.engine.tp", "--rank",
                                        str(r), "--spec", spec], env=env)
                      for r in range(1, self.size)]
        self.conns: list[Connection] = []
        self._closed = False
        try:
            for _ in self.procs:
                self.conns.append(self._accept())
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=self.size,
                                    timeout=datetime.timedelta(seconds=self.timeout))
        except BaseException:
            self.close()
            raise

    def _accept(self) -> Connection:
        deadline = time.monotonic() + 600  # a follower loads its shard first: minutes
        self._listener._listener._socket.settimeout(5.0)  # type: ignore[attr-defined]
        while True:
            self.check()
            try:
                return self._listener.accept()
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TPGroupError(
                        "tensor-parallel ranks did not start within 600 s") from None

    def check(self) -> None:
        """Raise :class:`TPGroupError` if a follower has exited."""
        for r, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                raise TPGroupError(f"tensor-parallel rank {r} (pid {p.pid}) exited with code "
                                   f"{p.returncode}: the group is down")

    def send(self, msg) -> None:
        self.check()
        try:
            for c in self.conns:
                c.send(msg)
        except OSError as e:
            raise TPGroupError(f"tensor-parallel follower unreachable: {e}") from e

    def share_pool(self, spec: dict) -> None:
        """Give every follower the pool; returns once each has mapped it."""
        self.send(("pool", spec))
        for r, c in enumerate(self.conns, 1):
            if not c.poll(self.timeout) or c.recv() != "mapped":
                raise TPGroupError(f"tensor-parallel rank {r} did not map the KV pool")
        if "path" in spec:
            os.unlink(spec["path"])  # every rank maps it; the memory lives until they unmap

    @property
    def pids(self) -> list[int]:
        return [os.getpid(), *(p.pid for p in self.procs)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self.conns:
            try:
                c.send(("stop", None))
                c.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self._listener.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# =================================================================================================
# Ranks 1..N-1
# =================================================================================================


def follower_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A follower rank of a tensor-parallel engine "
                                 "(started by rank 0; not for direct use).")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--spec", required=True)
    a = ap.parse_args(argv)
    spec = json.loads(a.spec)
    cfg = EngineConfig(**spec["cfg"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{a.rank} %(message)s")
    if cfg.device == "cpu":
        torch.set_num_threads(1)
    from baton.engine.engine import load_rank_model

    shard = TPShard(a.rank, cfg.tensor_parallel_size)
    model, layout, comm = load_rank_model(spec["model"], cfg, shard)
    conn = Client(tuple(spec["plan"]), authkey=bytes.fromhex(os.environ["BATON_TP_KEY"]))
    dist.init_process_group("gloo", init_method=spec["init"], rank=a.rank,
                            world_size=cfg.tensor_parallel_size,
                            timeout=datetime.timedelta(seconds=cfg.tp_timeout_s))
    return _follow(conn, model, cfg, layout, shard)


def _follow(conn: Connection, model, cfg: EngineConfig, layout, shard: TPShard) -> int:
    from baton.engine.runner import ModelRunner

    runner = None
    while True:
        try:
            kind, body = conn.recv()
        except (EOFError, OSError):
            log.info("rank 0 is gone; exiting")
            return 0
        if kind == "stop":
            return 0
        if kind == "pool":
            runner = ModelRunner(model, cfg, layout, storage=map_pool(body), rank=shard.rank)
            conn.send("mapped")
        elif kind == "step":
            assert runner is not None
            try:
                runner.forward_plan(body)
            except Exception as e:  # a collective failed: the group is down
                log.error("step failed: %s", e)
                return 1


if __name__ == "__main__":
    sys.exit(follower_main())
