"""CUDA graphs for decode steps.

A decode step of a small batch is hundreds of short kernel launches (ten per layer); launched
one by one from Python, their launch cost exceeds the step's own memory traffic. The runner
captures the whole forward pass once per batch size in ``sizes`` and replays it: the inputs are
copied into static buffers, the batch is padded to the next captured size with rows that store
nothing (block id -1) and attend to nothing (context 0), and the logits of the real rows are
returned.

The captured forward reads no tensor value on the host: the Triton decode kernel's context splits
are fixed per batch size (from ``max_model_len``), and every sequence splits its own context.
"""

from __future__ import annotations

import numpy as np
import torch
from baton.engine.model import AttentionMetadata, LlamaModel
from baton.kernels.triton_attention import decode_splits


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to ``max_batch`` (and ``max_batch`` itself)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv: torch.Tensor, max_batch: int, max_model_len: int,
                 block_size: int, sizes: list[int] | None = None) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.sizes = sorted(sizes or graph_batch_sizes(max_batch))
        self.max_batch = self.sizes[-1]
        self.width = -(-max_model_len // block_size)  # block-table columns
        dev = kv.device
        n = self.max_batch
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_blocks = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.slot_offsets = torch.zeros(n, dtype=torch.long, device=dev)
        self.tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.ctx = torch.zeros(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, device=dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.splits = {b: decode_splits(b, model.cfg.num_kv_heads, max_model_len, sms)
                       for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            self._forward(b)  # warm-up: compiles the Triton kernels outside the capture
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = g
        torch.cuda.synchronize(dev)

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_blocks=self.slot_blocks[:b], slot_offsets=self.slot_offsets[:b],
            decode_block_tables=self.tables[:b], decode_context_lens=self.ctx[:b],
            decode_splits=self.splits[b],
        )
        return self.model.forward(self.ids[:b], self.pos[:b], meta, self.kv, self.rows[:b])

    def batch_size_for(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    def run(self, ids: list[int], positions: list[int], slot_blocks: list[int],
            tables: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        """One decode step of ``len(ids)`` sequences (at most ``max_batch``): logits [n, vocab]."""
        n = len(ids)
        b = self.batch_size_for(n)
        assert b is not None, f"{n} sequences exceed the largest captured batch {self.max_batch}"
        pad = b - n
        self.ids[:b].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.pos[:b].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slot_blocks[:b].copy_(torch.tensor(slot_blocks + [-1] * pad), non_blocking=True)
        self.slot_offsets[:b].copy_(torch.tensor([p % self.block_size for p in positions]
                                                 + [0] * pad), non_blocking=True)
        rows = np.zeros((b, self.width), dtype=np.int32)
        for i, t in enumerate(tables):
            rows[i, : len(t)] = t
        self.tables[:b].copy_(torch.from_numpy(rows), non_blocking=True)
        self.ctx[:b].copy_(torch.tensor(context_lens + [0] * pad, dtype=torch.int32),
                           non_blocking=True)
        self.graphs[b].replay()
        return self.outputs[b][:n]
