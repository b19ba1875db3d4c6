"""Model runner: turns a :class:`ScheduledBatch` into tensors, runs the model, samples."""

from __future__ import annotations

import math
import mmap

import torch
from baton.engine.config import EngineConfig
from baton.engine.kv_cache import KVCacheManager
from baton.engine.model import AttentionMetadata, LlamaModel, PrefillSeq
from baton.engine.request import Request
from baton.engine.sampler import TokenLogprobs, sample
from baton.engine.scheduler import ScheduledBatch


def alloc_kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A zeroed KV pool. On CPU it is an anonymous mapping advised to use transparent huge pages:
    a hand-off reads blocks from another process (``process_vm_readv`` under UCX's cma), which
    pins pages one by one, so 2 MiB pages make it markedly cheaper."""
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    # the tensor keeps the mapping alive (it holds a reference to the buffer)
    kv = torch.frombuffer(region, dtype=dtype, count=math.prod(shape)).view(shape)
    # Fault every page in now: a first touch inside a hand-off (another process's
    # process_vm_readv filling a fresh page) costs ~20x the copy itself, and the pool's memory
    # should be committed at start-up, not discovered under load.
    kv.zero_()
    return kv


class ModelRunner:
    """Owns the KV tensor and runs the model on scheduled batches.

    kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (block-major, see
    docs/kv-layout.md): one block's keys and values for every layer form one contiguous region.
    """

    def __init__(self, model: LlamaModel, cfg: EngineConfig, num_blocks: int) -> None:
        self.model = model
        self.cfg = cfg
        mc = model.cfg
        self.kv = alloc_kv_pool((num_blocks, mc.num_layers, 2, cfg.block_size, mc.num_kv_heads,
                                 mc.head_dim), cfg.torch_dtype, cfg.device)
        self.generators: dict[str, torch.Generator] = {}

    @staticmethod
    def block_nbytes(model_cfg, cfg: EngineConfig) -> int:
        elem = torch.empty((), dtype=cfg.torch_dtype).element_size()
        return (model_cfg.num_layers * 2 * cfg.block_size * model_cfg.num_kv_heads
                * model_cfg.head_dim * elem)

    def execute(
        self, batch: ScheduledBatch, kv: KVCacheManager
    ) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Run one step. Returns the sampled token of every request whose known tokens are now all
        computed (prefill finished, or a decode step)."""
        bs = self.cfg.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        logits_rows: list[int] = []
        samplers: list[Request] = []
        row = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            end = start + n
            blocks = kv.block_ids(req.request_id)
            ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_blocks.extend(blocks[p // bs] for p in range(start, end))
            used = blocks[: -(-end // bs)]
            if n == 1:
                dec_rows.append(row)
                dec_tables.append(used)
                dec_lens.append(end)
            else:
                prefills.append(PrefillSeq(row, n, start, torch.tensor(used)))
            if end == req.num_tokens:
                logits_rows.append(row + n - 1)
                samplers.append(req)
            row += n

        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks),
            slot_offsets=torch.tensor(positions) % bs,
            prefills=prefills,
        )
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables])
            meta.decode_context_lens = torch.tensor(dec_lens)
            meta.decode_rows = None if not prefills else torch.tensor(dec_rows)
        logits = self.model.forward(torch.tensor(ids), torch.tensor(positions), meta, self.kv,
                                    torch.tensor(logits_rows, dtype=torch.long))
        if not samplers:
            return {}
        tokens, logprobs = sample(logits, [r.params for r in samplers],
                                  [self.generators[r.request_id] for r in samplers])
        return {r.request_id: (t, lp) for r, t, lp in zip(samplers, tokens, logprobs)}
