"""How a worker's KV pool lies in memory, and which regions a hand-off between two pools moves.

Every kernel sees the cache as ``[num_blocks, num_layers, 2, block_size, H, head_dim]`` with any
strides (head_dim contiguous). Underneath, a pool is one of two layouts:

``head`` (KV-head-major, the default)::

    storage: [slots, num_blocks, num_layers, 2, block_size, head_dim]

  A slot holds one KV head; a tensor-parallel group of ``tp`` ranks gives rank ``r`` the slots
  ``[r * S / tp, (r + 1) * S / tp)``. With fewer KV heads than ranks each rank gets a replica of
  the one head its query heads use (slot ``r`` holds head ``r * H // tp``), as vLLM replicates
  them. One (slot, block) is a contiguous chunk, and a slot's consecutive blocks are consecutive
  chunks: a hand-off moves, per head a reader rank needs, one region per run of consecutive
  blocks, whatever the two groups' TP sizes.

``block`` (block-major, one rank only)::

    storage: [num_blocks, num_layers, 2, block_size, H, head_dim]

  One block of every head is one chunk: a hand-off moves one region per run of consecutive
  blocks, the fewest descriptors there are, but only to another block-major pool (a head's rows
  are interleaved with the others').

A hand-off's plan (:meth:`KVLayout.read_pairs`) pairs each of the reader's slots with a holder
slot holding the same head; chunk ``i`` of a pool is slot ``i // num_blocks``, block
``i % num_blocks``, so NIXL (which merges consecutive descriptors) issues one request per
(slot pair, run of consecutive blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("head", "block")


class LayoutMismatch(ValueError):
    """Two pools whose blocks cannot be moved between each other; names both layouts."""


@dataclass(frozen=True)
class KVLayout:
    kind: str  # "head" | "block"
    num_layers: int
    block_size: int
    num_kv_heads: int  # the model's
    head_dim: int
    dtype: str  # the element type as torch names it: "float32", "bfloat16", "float8_e4m3fn"
    tp: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kv layout {self.kind!r}: must be one of {KINDS}")
        if self.kind == "block" and self.tp != 1:
            raise ValueError(f"the block-major KV layout holds one rank's heads; tensor "
                             f"parallelism ({self.tp} ranks) needs --kv-layout head")
        h, tp = self.num_kv_heads, self.tp
        if tp > 1 and (h % tp if h >= tp else tp % h):
            raise ValueError(f"{h} KV heads cannot be split over {tp} ranks (one must divide "
                             "the other)")

    @classmethod
    def of(cls, model_cfg, block_size: int, dtype: torch.dtype, kind: str = "head",
           tp: int = 1) -> KVLayout:
        return cls(kind, model_cfg.num_layers, block_size, model_cfg.num_kv_heads,
                   model_cfg.head_dim, str(dtype).removeprefix("torch."), tp)

    # ---- geometry ------------------------------------------------------------------------------

    @property
    def slots(self) -> tuple[int, ...]:
        """The KV head each slot holds (head-major); ``(-1,)`` for block-major's one slot of
        every head."""
        if self.kind == "block":
            return (-1,)
        if self.num_kv_heads >= self.tp:
            return tuple(range(self.num_kv_heads))
        return tuple(r * self.num_kv_heads // self.tp for r in range(self.tp))

    def rank_slots(self, rank: int) -> range:
        n = len(self.slots) // self.tp
        return range(rank * n, (rank + 1) * n)

    @property
    def elem_size(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one (slot, block): every layer's keys and values of one block."""
        heads = self.num_kv_heads if self.kind == "block" else 1
        return self.num_layers * 2 * self.block_size * heads * self.head_dim * self.elem_size

    @property
    def block_nbytes(self) -> int:
        """Bytes one block takes in the pool, every slot (replicas included)."""
        return self.chunk_nbytes * len(self.slots)

    def storage_shape(self, num_blocks: int) -> tuple[int, ...]:
        rest = (self.num_layers, 2, self.block_size)
        if self.kind == "block":
            return (num_blocks, *rest, self.num_kv_heads, self.head_dim)
        return (len(self.slots), num_blocks, *rest, self.head_dim)

    def view(self, storage: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The kernels' ``[N, L, 2, bs, H, D]`` view of ``storage``: rank ``rank``'s slots, or
        every slot (``None``: what the tiers, checksums and staging copy per block)."""
        if self.kind == "block":
            return storage
        s = storage if rank is None else storage[self.rank_slots(rank).start:
                                                 self.rank_slots(rank).stop]
        return s.permute(1, 2, 3, 4, 0, 5)

    def num_blocks(self, storage: torch.Tensor) -> int:
        return storage.shape[0 if self.kind == "block" else 1]

    # ---- the wire ------------------------------------------------------------------------------

    def describe(self) -> str:
        """``head-major x2 ranks [0 1 | 2 3] 16x64x30 bfloat16``: kind, ranks and their heads,
        block size x head dim x layers, element type."""
        if self.kind == "block":
            heads = f"{self.num_kv_heads} heads"
        else:
            per = [" ".join(str(self.slots[s]) for s in self.rank_slots(r))
                   for r in range(self.tp)]
            heads = f"x{self.tp} ranks [{' | '.join(per)}]"
        return (f"{self.kind}-major {heads} {self.block_size}x{self.head_dim}x{self.num_layers} "
                f"{self.dtype}")

    def to_wire(self) -> str:
        return (f"{self.kind}:{self.num_layers}:{self.block_size}:{self.num_kv_heads}:"
                f"{self.head_dim}:{self.dtype}:{self.tp}")

    @classmethod
    def from_wire(cls, s: str) -> KVLayout:
        try:
            kind, layers, bs, heads, dim, dtype, tp = s.split(":")
            return cls(kind, int(layers), int(bs), int(heads), int(dim), dtype, int(tp))
        except ValueError as e:
            raise LayoutMismatch(f"unreadable KV layout {s!r}: {e}") from e

    # ---- hand-off ------------------------------------------------------------------------------

    def read_pairs(self, holder: KVLayout) -> list[tuple[int, int]]:
        """(our slot, holder slot) for each of our slots: the chunks a hand-off from ``holder``
        READs. Raises :class:`LayoutMismatch` naming both layouts where they cannot map."""
        why = self._mismatch(holder)
        if why:
            raise LayoutMismatch(f"KV layouts do not map ({why}): holder {holder.describe()}, "
                                 f"reader {self.describe()}")
        if self.kind == "block":
            return [(0, 0)]
        theirs: dict[int, list[int]] = {}
        for s, h in enumerate(holder.slots):
            theirs.setdefault(h, []).append(s)
        # a head the holder replicates is read from its replicas in turn, spreading the reads
        return [(s, theirs[h][s % len(theirs[h])]) for s, h in enumerate(self.slots)]

    def _mismatch(self, holder: KVLayout) -> str:
        for f in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype"):
            if getattr(self, f) != getattr(holder, f):
                return f"{f} {getattr(holder, f)} vs {getattr(self, f)}"
        if self.kind != holder.kind:
            return "a block-major pool interleaves every head in a block; only another " \
                   "block-major pool can read it or be read into"
        return ""

    def descriptors(self, holder: KVLayout, runs: int) -> dict[tuple[int, int], int]:
        """Descriptors per (holder rank, reader rank) of a hand-off of ``runs`` runs of
        consecutive blocks (each run consecutive on both sides)."""
        out: dict[tuple[int, int], int] = {}
        hold_rank = {s: r for r in range(holder.tp) for s in holder.rank_slots(r)}
        for ours, theirs in self.read_pairs(holder):
            key = (hold_rank[theirs], ours // (len(self.slots) // self.tp))
            out[key] = out.get(key, 0) + runs
        return out


def chunk_ids(pairs: list[tuple[int, int]], local_blocks, remote_blocks, local_n: int,
              remote_n: int) -> tuple[list[int], list[int]]:
    """The (local, remote) chunk indices of a READ: for each slot pair, each block in order."""
    local: list[int] = []
    remote: list[int] = []
    for ls, rs in pairs:
        local.extend(ls * local_n + int(b) for b in local_blocks)
        remote.extend(rs * remote_n + int(b) for b in remote_blocks)
    return local, remote

