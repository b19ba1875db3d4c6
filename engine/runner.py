"""Model runner: turns a :class:`ScheduledBatch` into tensors, runs the model, samples."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch
from baton.engine.config import EngineConfig
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_layout import KVLayout
from baton.engine.model import AttentionMetadata, LlamaModel, PrefillSeq, advise_huge_pages
from baton.engine.request import Request
from baton.engine.sampler import History, TokenLogprobs, sample, token_seed
from baton.engine.scheduler import ScheduledBatch


def alloc_kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A zeroed KV pool. On CPU it is an anonymous mapping advised to use transparent huge pages
    (unless ``$BATON_HUGE_PAGES=0``: :func:`~baton.engine.model.advise_huge_pages`): a hand-off
    reads blocks from another process (``process_vm_readv`` under UCX's cma), which pins pages
    one by one, so 2 MiB pages make it markedly cheaper."""
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(region)
    # the tensor keeps the mapping alive (it holds a reference to the buffer)
    kv = torch.frombuffer(region, dtype=dtype, count=math.prod(shape)).view(shape)
    # Fault every page in now: a first touch inside a hand-off (another process's
    # process_vm_readv filling a fresh page) costs ~20x the copy itself, and the pool's memory
    # should be committed at start-up, not discovered under load.
    kv.zero_()
    return kv


def allowed(matcher, vocab: int) -> torch.Tensor:
    """The tokens ``matcher`` allows next, as a bool mask over the model's ``vocab`` logits."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                         bitorder="little")[:vocab]
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[: len(bits)] = torch.from_numpy(bits.astype(bool))
    return mask


def history(req: Request) -> History:
    """What ``req``'s logit processing reads: a migrated request's ``output_prefix`` counts as
    output; EOS (unless ignored) and ``stop_token_ids`` are what ``min_tokens`` holds back."""
    p = req.params
    cut = req.num_prompt_tokens - req.num_prior_output
    prompt = req.prompt_token_ids[:cut]
    output = req.prompt_token_ids[cut:] + req.output_token_ids
    stops = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(req.eos_token_ids))
    return History(tuple(prompt), tuple(output), stops)


class ModelRunner:
    """Owns the KV pool and runs the model on scheduled batches.

    ``storage`` is the pool as ``layout`` lays it out (``engine/kv_layout.py``); ``kv`` the
    kernels' ``[num_blocks, num_layers, 2, block_size, H, head_dim]`` view of this rank's KV
    heads, ``kv_all`` the same view of every head (what the KV tiers, checksums and hand-offs
    copy per block). A rank of a tensor-parallel group (``tp``: rank 0's
    :class:`baton.engine.tp.TPGroup`) maps the group's shared ``storage``.
    """

    def __init__(self, model: LlamaModel, cfg: EngineConfig, layout: KVLayout,
                 num_blocks: int = 0, max_model_len: int | None = None, *,
                 storage: torch.Tensor | None = None, rank: int = 0, tp=None) -> None:
        self.model = model
        self.cfg = cfg
        self.layout, self.rank, self.tp = layout, rank, tp
        mc = model.cfg
        if storage is None:
            shape = layout.storage_shape(num_blocks)
            if tp is not None:
                from baton.engine.tp import shared_pool

                storage, spec = shared_pool(shape, cfg.kv_dtype, cfg.device)
                tp.share_pool(spec)
            else:
                storage = alloc_kv_pool(shape, cfg.kv_dtype, cfg.device)
        self.storage = storage
        self.kv = layout.view(storage, rank)
        self.kv_all = layout.view(storage)
        self.generators: dict[str, torch.Generator] = {}
        self.device = self.kv.device
        self.triton = model.attention_backend == "triton"
        self.graphs = None
        self._sms = 4  # the interpreter on CPU: a few programs are as good as many
        if self.triton:
            from baton.kernels.triton_attention import decode_splits

            self._decode_splits = decode_splits
        if self.triton and self.device.type == "cuda":
            self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            if cfg.cuda_graphs and layout.tp == 1:  # graphs hold no collectives
                from baton.engine.cuda_graphs import DecodeGraphs

                self.graphs = DecodeGraphs(model, self.kv, cfg.max_num_seqs,
                                           max_model_len or mc.max_position, cfg.block_size)

    @staticmethod
    def block_nbytes(model_cfg, cfg: EngineConfig) -> int:
        """Bytes one block takes in a pool of ``cfg`` (every KV head, replicas included)."""
        return KVLayout.of(model_cfg, cfg.block_size, cfg.kv_dtype, cfg.kv_layout,
                           cfg.tensor_parallel_size).block_nbytes

    def execute(
        self, batch: ScheduledBatch, kv: KVCacheManager
    ) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Run one step. Returns the sampled token of every request whose known tokens are now all
        computed (prefill finished, or a decode step)."""
        ids, positions, slot_blocks, dec_rows, dec_tables, dec_lens, prefills, logits_rows, \
            samplers = self._layout(batch, kv)
        if self.graphs is not None and not prefills and self.graphs.batch_size_for(len(ids)):
            logits = self.graphs.run(ids, positions, slot_blocks, dec_tables, dec_lens)
            if len(logits_rows) != len(ids):  # a 1-token prompt chunk that is not the last
                logits = logits[torch.tensor(logits_rows, device=logits.device)]
        else:
            logits = self._forward(ids, positions, slot_blocks, dec_rows, dec_tables, dec_lens,
                                   prefills, logits_rows)
        if not samplers:
            return {}
        if logits.device.type != "cpu" and not all(
                r.params.greedy and r.params.logprobs is None and r.matcher is None
                and not r.params.processes_logits for r in samplers):
            logits = logits.cpu()  # seeded sampling draws from CPU generators
        histories = ([history(r) for r in samplers]
                     if any(r.params.processes_logits for r in samplers) else None)
        for r in samplers:  # each seeded draw from (seed, position): any worker draws the same
            if r.params.seed is not None and not r.params.greedy:
                self.generators[r.request_id].manual_seed(
                    token_seed(r.params.seed, r.num_prior_output + r.num_output_tokens))
        masks = [allowed(r.matcher, logits.shape[-1]) if r.matcher is not None else None
                 for r in samplers]
        tokens, logprobs = sample(logits, [r.params for r in samplers],
                                  [self.generators[r.request_id] for r in samplers], histories,
                                  masks if any(m is not None for m in masks) else None)
        for r, t in zip(samplers, tokens):
            if r.matcher is not None:
                r.matcher.consume_token(t)
        return {r.request_id: (t, lp) for r, t, lp in zip(samplers, tokens, logprobs)}

    def _layout(self, batch: ScheduledBatch, kv: KVCacheManager) -> tuple:
        """The step's rows, one per new token, requests in batch order::

            ids, positions, slot_blocks   per row: token, position, the block its KV goes to
            dec_rows, dec_tables, dec_lens   decode rows (1 new token): row, blocks, length
            prefills                      prompt chunks (2+ new tokens): PrefillSeq each
            logits_rows, samplers         the rows whose next token is sampled, and whose
        """
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
        return (ids, positions, slot_blocks, dec_rows, dec_tables, dec_lens, prefills,
                logits_rows, samplers)

    def _forward(self, ids, positions, slot_blocks, dec_rows, dec_tables, dec_lens, prefills,
                 logits_rows) -> torch.Tensor:
        """One eager forward pass: the batch's host lists as tensors on the KV cache's device.
        In a tensor-parallel group rank 0 sends the same lists to every follower first, which
        run the same pass on their shards (:meth:`forward_plan`)."""
        plan = (ids, positions, slot_blocks, dec_rows, dec_tables, dec_lens,
                [(p.start, p.n, p.num_past, p.block_table.tolist()) for p in prefills],
                logits_rows)
        if self.tp is not None:
            self.tp.send(("step", plan))
        return self.forward_plan(plan)

    def forward_plan(self, plan) -> torch.Tensor:
        """:meth:`_forward` of a step plan (host lists only: what rank 0 sends its followers)."""
        ids, positions, slot_blocks, dec_rows, dec_tables, dec_lens, chunks, logits_rows = plan
        prefills = [PrefillSeq(a, n, past, torch.tensor(t)) for a, n, past, t in chunks]
        dev, bs = self.device, self.cfg.block_size

        def put(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        meta = AttentionMetadata(slot_blocks=put(slot_blocks),
                                 slot_offsets=put([p % bs for p in positions]), prefills=prefills)
        table_dtype = torch.int32 if self.triton else torch.long
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            meta.decode_block_tables = put([t + [0] * (width - len(t)) for t in dec_tables],
                                           table_dtype)
            meta.decode_context_lens = put(dec_lens, table_dtype)
            meta.decode_rows = None if not prefills else put(dec_rows)
            if self.triton:
                meta.decode_splits = self._decode_splits(
                    len(dec_rows), self.model.cfg.num_kv_heads, max(dec_lens), self._sms)
        if prefills and self.triton:
            width = max(len(p.block_table) for p in prefills)
            meta.prefill_block_tables = put(
                [p.block_table.tolist() + [0] * (width - len(p.block_table)) for p in prefills],
                torch.int32)
            meta.prefill_starts = put([p.start for p in prefills], torch.int32)
            meta.prefill_lens = put([p.n for p in prefills], torch.int32)
            meta.prefill_past = put([p.num_past for p in prefills], torch.int32)
            meta.max_prefill_len = max(p.n for p in prefills)
        return self.model.forward(put(ids), put(positions), meta, self.kv, put(logits_rows))
