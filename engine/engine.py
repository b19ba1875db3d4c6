"""The engine: submission, the step loop, outputs, and the prefill/decode hand-off roles.

Step = schedule -> run -> sample -> update requests -> collect outputs.

Roles (one engine class, three ways to use it):

* **both** (colocated): ``add_request`` then ``step`` until finished.
* **prefill**: ``add_request(..., prefill_only=True)``. When the prompt is computed and the first
  token sampled, the request finishes with reason ``"prefilled"`` and its output carries a
  :class:`KVHandoff`; the blocks stay pinned until ``release_handoff``.
* **decode**: ``reserve_handoff`` allocates blocks for the prompt (reusing this engine's own prefix
  cache where it can) and returns :class:`HandoffSlots`; the caller fills the missing blocks (a copy
  in-process, NIXL between processes) and calls ``commit_handoff``, after which the request decodes
  like any other. ``abort`` frees reserved blocks at any point.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from baton.engine import fp8, tp
from baton.engine.block_hash import namespace_for
from baton.engine.config import EngineConfig
from baton.engine.errors import DuplicateRequestError, InvalidRequestError, RequestTooLargeError
from baton.engine.gpu_memory import DeviceMemory, activation_reserve, check_cuda_device
from baton.engine.grammar import Grammars
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_layout import KVLayout
from baton.engine.kv_tiers import DiskTier, DiskTierBusy, HostTier, TierStore
from baton.engine.loader import LoadedModel, Placement, check_model, load_config, load_model
from baton.engine.model import LlamaModel
from baton.engine.params import SamplingParams
from baton.engine.request import FINISH_REASONS, Request, RequestStatus
from baton.engine.runner import ModelRunner
from baton.engine.sampler import TokenLogprobs, make_generator
from baton.engine.scheduler import Scheduler
from baton.engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger("baton.engine")


@dataclass(frozen=True)
class KVHandoff:
    """What a prefill engine hands over: the blocks holding the prompt's KV, and the first token."""

    request_id: str
    fingerprint: str
    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens whose KV the blocks hold
    prompt_token_ids: tuple[int, ...]
    first_token_id: int


@dataclass(frozen=True)
class HandoffSlots:
    """Blocks a decode engine reserved for an incoming request.

    ``block_ids[i]`` must receive the KV of the sender's ``block_ids[i]``; the first
    ``num_local_blocks`` already hold it (this engine's prefix cache) and need no transfer.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_local_blocks: int


@dataclass
class RequestOutput:
    """The delta a request produced in one step (plus totals, and ``handoff`` for prefill-only)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # pool / host / disk
    handoff: KVHandoff | None = None
    queue_s: float | None = None  # arrival to first scheduled (None: not scheduled here)
    first_token_s: float | None = None  # arrival to the first token sampled here


@dataclass
class Completion:
    """A finished request, as :meth:`LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    """The engine's load as the services report it (metrics, the prefix index, worker info)."""

    waiting: int  # requests queued
    running: int  # requests in the running batch
    free_blocks: int  # KV blocks free (cached ones included)
    total_blocks: int
    quarantined_blocks: int = 0  # held for a transfer that may still write them
    prefill_tokens: int = 0  # prompt tokens still to compute, queued and running


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of ``text`` already returned


def placement(cfg: EngineConfig, rank: int = 0) -> Placement:
    """Where an engine of ``cfg`` keeps its weights: the compute dtype on its device, each value
    rounded to the storage dtype; an FP8 checkpoint's linear weights FP8 where this engine has
    FP8 matmuls (a GPU with FP8 tensor cores, or the Triton kernels interpreted on CPU); under
    tensor parallelism, rank ``rank``'s shard only."""
    storage, compute = cfg.torch_dtype, cfg.compute_dtype
    n = cfg.tensor_parallel_size
    return Placement(compute, cfg.device, None if storage == compute else storage,
                     fp8=fp8_matmul_available(cfg), shard=tp.TPShard(rank, n) if n > 1 else None)


def fp8_matmul_available(cfg: EngineConfig) -> bool:
    """Whether an engine of ``cfg`` runs FP8 matmuls: Triton's FP8 dot needs sm_89 or newer."""
    if cfg.device == "cpu":
        return cfg.attention_backend == "triton"
    return torch.cuda.is_available() and torch.cuda.get_device_capability(cfg.device) >= (8, 9)


def placed_weights(model: LoadedModel, cfg: EngineConfig, rank: int = 0) -> dict:
    """``model``'s weights as an engine of ``cfg`` keeps them: as they are when the loader
    already wrote them there, else converted (a copy; FP8 weights dequantized)."""
    if model.placement == placement(cfg, rank):
        return model.weights
    if cfg.tensor_parallel_size > 1:
        raise InvalidRequestError("tensor_parallel_size", cfg.tensor_parallel_size,
                                  "a tensor-parallel engine loads its own shard: start it with "
                                  "LLMEngine.from_path")
    storage, compute = cfg.torch_dtype, cfg.compute_dtype
    out = {}
    for k, v in model.weights.items():
        if k.endswith(".scale") and k[:-len(".scale")] in model.weights:
            continue
        if k.endswith(".kv_scale"):  # float32 as read: peers must divide by the same
            out[k] = v
            continue
        if v.dtype == torch.float8_e4m3fn:
            v = fp8.dequantize_rows(v, model.weights[k + ".scale"], model.fp8_group)
        out[k] = v.to(storage).to(compute).to(cfg.device)
    return out


def engine_fingerprint(model: LoadedModel, cfg: EngineConfig) -> str:
    """The fingerprint of ``model`` as an engine of ``cfg`` runs it: its FP8 matmuls and KV
    cache dtype included."""
    return model.fingerprint(cfg.dtype, cfg.block_size, cfg.device,
                             fp8_matmul=fp8_group(model, cfg) is not None,
                             kv_dtype=cfg.kv_cache_dtype)


def fp8_group(model: LoadedModel, cfg: EngineConfig, rank: int = 0) -> int | None:
    """The FP8 matmul's scale group an engine of ``cfg`` runs ``model`` with (None: none)."""
    return model.fp8_group if model.placement == placement(cfg, rank) else None


def build_model(model: LoadedModel, cfg: EngineConfig, rank: int = 0) -> LlamaModel:
    """The engine's model of ``model``: rank ``rank``'s share of it under tensor parallelism."""
    mc, n = model.config, cfg.tensor_parallel_size
    tp.check_model(mc, n)
    storage, compute = cfg.torch_dtype, cfg.compute_dtype
    weights = placed_weights(model, cfg, rank)
    # GGUF blocks hold the float32 weights exactly, and the bf16 ones once each weight is
    # rounded to bf16 as it is read (the model decides which products read them)
    blocks = (cfg.device == "cpu" and compute == torch.float32
              and storage in (torch.float32, torch.bfloat16))
    comm = tp.TPComm(tp.TPShard(rank, n), mc.vocab_size) if n > 1 else None
    return LlamaModel(tp.local_config(mc, n), weights, compute, cfg.attention_backend, storage,
                      cfg.gemm_dtype, model.quantized if blocks else None,
                      fp8_group=fp8_group(model, cfg, rank), tp=comm)


def layout_of(model: LoadedModel, cfg: EngineConfig) -> KVLayout:
    return KVLayout.of(model.config, cfg.block_size, cfg.kv_dtype, cfg.kv_layout,
                       cfg.tensor_parallel_size)


def load_rank_model(path: str, cfg: EngineConfig, shard: tp.TPShard
                    ) -> tuple[LlamaModel, KVLayout, tp.TPComm]:
    """A follower rank's model (its shard only) and the group's KV layout."""
    model = load_model(path, place=placement(cfg, shard.rank))
    lm = build_model(model, cfg, shard.rank)
    return lm, layout_of(model, cfg), lm.tp


class LLMEngine:
    def __init__(self, model: LoadedModel, cfg: EngineConfig | None = None, *,
                 tp_group: tp.TPGroup | None = None) -> None:
        """``tp_group``: rank 0's followers, when ``cfg.tensor_parallel_size`` > 1 (see
        :meth:`from_path`, which starts them)."""
        self.cfg = cfg = cfg or EngineConfig()
        if cfg.tensor_parallel_size > 1 and tp_group is None:
            raise InvalidRequestError("tensor_parallel_size", cfg.tensor_parallel_size,
                                      "a tensor-parallel engine starts its ranks itself: "
                                      "build it with LLMEngine.from_path")
        self.tp_group = tp_group
        if cfg.num_threads or tp_group is not None:  # one torch thread per CPU rank
            torch.set_num_threads(1 if tp_group is not None else cfg.num_threads)
        self.model_info = model
        self.model_config = mc = model.config
        self.tokenizer = model.tokenizer
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.max_model_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        self.fp8_group = fp8_group(model, cfg)
        self.fingerprint = engine_fingerprint(model, cfg)
        compute = cfg.compute_dtype
        device_memory = None
        if cfg.device != "cpu":
            check_cuda_device(cfg.device)
            device_memory = DeviceMemory(cfg.device)
        self.model = build_model(model, cfg)
        self.attention_backend = self.model.attention_backend
        self.block_nbytes = ModelRunner.block_nbytes(mc, cfg)
        # on CUDA without --num-blocks: the device's share after the weights (gpu_memory)
        self.memory_plan = None
        if device_memory is not None and cfg.num_kv_blocks is None:
            reserve = activation_reserve(mc, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                         torch.empty((), dtype=compute).element_size())
            self.memory_plan = device_memory.plan(cfg.gpu_memory_utilization,
                                                  self.block_nbytes, reserve)
        num_blocks = (cfg.num_kv_blocks or (self.memory_plan and self.memory_plan.num_blocks)
                      or max(1, cfg.kv_cache_bytes // self.block_nbytes))
        self.kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 cfg.record_kv_events)
        self.scheduler = Scheduler(cfg, self.kv)
        self.runner = ModelRunner(self.model, cfg, layout_of(model, cfg), num_blocks,
                                  self.max_model_len, tp=tp_group)
        self.tiers = self._make_tiers()
        # what the device holds for this engine once the pool and the graphs exist
        self.device_reserved = device_memory.used_now() if device_memory is not None else 0
        self.requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self._aborted: list[RequestOutput] = []
        self._ids = itertools.count()

    def _make_tiers(self) -> TierStore | None:
        """The KV tiers under the pool (``baton.engine.kv_tiers``), or None without any."""
        cfg, kv = self.cfg, self.runner.kv_all
        if not cfg.enable_prefix_caching or not (cfg.kv_host_tier_bytes or cfg.kv_disk_tier_bytes):
            return None
        if kv.dtype == torch.float8_e4m3fn:  # the tiers move bytes (torch has no FP8 gathers
            kv = kv.view(torch.uint8)       # on CPU), one per element: the same blocks
        shape, events = kv.shape[1:], self.kv.pool.events
        tiers: list = []
        if cfg.kv_host_tier_bytes:
            n = cfg.kv_host_tier_bytes // self.block_nbytes
            if n < 1:
                raise InvalidRequestError("kv_host_tier_bytes", cfg.kv_host_tier_bytes,
                                          f"holds no block of {self.block_nbytes} bytes")
            tiers.append(HostTier(n, shape, kv.dtype, pin=cfg.device != "cpu", events=events))
        if cfg.kv_disk_tier_bytes:
            try:
                tiers.append(DiskTier(cfg.kv_disk_tier_dir, cfg.kv_disk_tier_bytes, shape,
                                      kv.dtype, self.fingerprint, events))
            except DiskTierBusy as e:
                raise InvalidRequestError("kv_disk_tier_dir", cfg.kv_disk_tier_dir,
                                          str(e)) from None
            except ValueError as e:  # no room for one block
                raise InvalidRequestError("kv_disk_tier_bytes", cfg.kv_disk_tier_bytes,
                                          str(e)) from None
            except OSError as e:  # a full or unwritable disk: serve without the tier
                log.error("KV disk tier off: %s", e)
        if not tiers:
            return None
        store = TierStore(kv, tiers)
        self.kv.tiers = store
        self.kv.pool.on_evict = store.offload
        return store

    def close(self) -> None:
        """Stop the tiers' writer (the disk tier's queued blocks are written first)."""
        if self.tiers is not None:
            self.tiers.close()
        if self.tp_group is not None:
            self.tp_group.close()

    @classmethod
    def from_path(cls, path: str | None = None, cfg: EngineConfig | None = None) -> LLMEngine:
        """Load ``path`` straight into this engine's dtype and device (one tensor at a time).
        With ``tensor_parallel_size`` N > 1, first start ranks 1..N-1 (each loads its own
        shard meanwhile), then load rank 0's."""
        cfg = cfg or EngineConfig()
        if cfg.device != "cpu":  # before any weight goes there: a clear error, not torch's
            check_cuda_device(cfg.device)
        if cfg.tensor_parallel_size == 1:
            return cls(load_model(path, place=placement(cfg)), cfg)
        model_path = str(check_model(path))
        tp.check_model(load_config(model_path), cfg.tensor_parallel_size)
        group = tp.TPGroup(model_path, cfg)
        try:
            return cls(load_model(model_path, place=placement(cfg)), cfg, tp_group=group)
        except BaseException:
            group.close()
            raise

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    def stats(self) -> EngineStats:
        """The engine's load: plain counter reads, safe from any thread (a moment's view)."""
        sched, pool = self.scheduler, self.kv.pool
        return EngineStats(len(sched.waiting), len(sched.running), pool.num_free_blocks,
                           pool.num_blocks, self.kv.num_quarantined_blocks,
                           sched.prefill_tokens_left)

    @property
    def kv_events(self):
        """The prefix cache's block events (stored, evicted, cleared) for a publisher to drain,
        or None when ``record_kv_events`` is off."""
        return self.kv.pool.events

    @property
    def kv_cache(self) -> torch.Tensor:
        """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (every head, any
        strides: ``engine/kv_layout.py``); block b is kv[b]."""
        return self.runner.kv_all

    @property
    def ranks(self) -> str:
        """The engine's ranks and where they run: ``1 rank on cpu``, ``2 ranks on cuda:0
        (pids 10 11)``."""
        if self.tp_group is None:
            return f"1 rank on {self.cfg.device}"
        pids = " ".join(str(p) for p in self.tp_group.pids)
        return f"{self.tp_group.size} ranks on {self.cfg.device} (pids {pids})"

    @property
    def kv_storage(self) -> torch.Tensor:
        """The KV pool as it lies in memory (what a NIXL agent registers), per
        :attr:`kv_layout`."""
        return self.runner.storage

    @property
    def kv_layout(self) -> KVLayout:
        return self.runner.layout

    # =============================================================================================
    # Submission
    # =============================================================================================

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request. Raises :class:`InvalidRequestError` naming the bad input;
        nothing about other requests changes when it does. ``arrival_time`` (``time.monotonic``;
        default now): when it reached the engine's caller, so that its queue time counts the
        step that was running then."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt, prompt_token_ids, messages)
        req = self._make_request(request_id, ids, params, prefill_only)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.scheduler.add(req)
        return req

    def _prompt_ids(self, prompt, prompt_token_ids, messages) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise InvalidRequestError("prompt", None,
                                      "give exactly one of prompt, prompt_token_ids, messages")
        if messages is not None:
            if not messages:
                raise InvalidRequestError("messages", messages, "must not be empty")
            ids = self.tokenizer.encode_chat(messages)
        elif prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("prompt", prompt, "must be a non-empty string")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt_token_ids)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError("prompt_token_ids", bad[:5],
                                          f"token ids must be integers in [0, {vocab})")
        if not ids:
            raise InvalidRequestError("prompt", "", "the prompt has no tokens")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"<{len(ids)} tokens>",
                f"{len(ids)} tokens do not fit the context length {self.max_model_len} "
                "(one position is needed for the first generated token)")
        return ids

    def _make_request(self, request_id, ids, params, prefill_only) -> Request:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise DuplicateRequestError("request_id", rid, "already in use")
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        if params.fit_pool:  # an upper bound: as many as the pool holds beside the prompt
            max_tokens = max(1, min(max_tokens, self.num_blocks * self.cfg.block_size
                                    - len(ids)))
        need_tokens = len(ids) + (1 if prefill_only else max_tokens)
        need = self.kv.blocks_needed(need_tokens)
        if need > self.num_blocks:
            raise RequestTooLargeError(
                "prompt", f"<{len(ids)} tokens + max_tokens {max_tokens}>",
                f"needs {need} KV blocks of {self.cfg.block_size} tokens, the pool has "
                f"{self.num_blocks}")
        req = Request(rid, ids, params, namespace_for(self.fingerprint, params.cache_salt),
                      self.cfg.block_size, max_tokens, prefill_only,
                      eos_token_ids=self.model_config.eos_token_ids or self.tokenizer.eos_token_ids)
        if params.grammar:  # compiled (or copied from the cache) before the request runs
            req.matcher = self.grammars().matcher(params.grammar)
            Grammars.follow(req.matcher,  # a migrated request's tokens
                            ids[len(ids) - req.num_prior_output:])
        self.requests[rid] = req
        self.runner.generators[rid] = make_generator(params.seed)
        if params.detokenize:
            self._text[rid] = _TextState(IncrementalDetokenizer(self.tokenizer, ids))
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request at any point and free its blocks. False if it is not (or no longer)
        here."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status == RequestStatus.FINISHED_PREFILLED:
            self.release_handoff(request_id)
            return True
        if req.status == RequestStatus.RESERVED:
            self.kv.free(request_id)
            req.status = RequestStatus.FINISHED_ABORTED
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._aborted.append(self._output(req, [], [], None))
        self._forget(req)
        return True

    # =============================================================================================
    # Hand-off between engines
    # =============================================================================================

    def _handoff(self, request_id: str, status: RequestStatus) -> Request:
        """The request in hand-off state ``status``; KeyError if there is none."""
        req = self.requests.get(request_id)
        if req is None or req.status != status:
            raise KeyError(f"no {status.name.lower()} hand-off for request {request_id!r}")
        return req

    def release_handoff(self, request_id: str) -> None:
        """Prefill side: the receiver has its copy (or gave up); unpin the blocks."""
        req = self._handoff(request_id, RequestStatus.FINISHED_PREFILLED)
        self.kv.free(request_id)
        self._forget(req)

    def reserve_handoff(
        self, request_id: str, prompt_token_ids: Sequence[int], first_token_id: int,
        params: SamplingParams,
    ) -> HandoffSlots | None:
        """Decode side: allocate blocks for a prompt whose KV comes from elsewhere. Nothing of
        the sampler travels: a seeded draw depends on (seed, output position) only.

        Returns ``None`` if the blocks are not free now, or the running batch (with the hand-offs
        already reserved) is at ``max_num_seqs`` (try later). Raises like ``add_request``
        for a request that is invalid or can never fit.
        """
        ids = self._prompt_ids(None, prompt_token_ids, None)
        req = self._make_request(request_id, ids, params, prefill_only=False)
        req.append_token(first_token_id)
        if req.matcher is not None:  # the matcher rebuilt from the handed first token
            try:
                Grammars.follow(req.matcher, [first_token_id])
            except InvalidRequestError:
                self._forget(req)
                raise
        reserved = sum(r.status == RequestStatus.RESERVED for r in self.requests.values())
        if len(self.scheduler.running) + reserved >= self.cfg.max_num_seqs:
            self._forget(req)  # a hand-off joins the running batch: never past its limit
            return None
        hit = self.kv.get_prefix_hit(req).truncated(len(ids) // self.cfg.block_size)
        if self.kv.allocate_slots(req, len(ids) - hit.num_tokens, hit) is None:
            self._forget(req)
            return None
        hit_blocks = hit.num_tokens // self.cfg.block_size  # tier blocks that failed: read
        req.num_cached_tokens = hit.num_tokens
        req.cached_tokens_by_tier = hit.tokens_by_tier()
        req.status = RequestStatus.RESERVED
        return HandoffSlots(req.request_id, tuple(self.kv.block_ids(req.request_id)), hit_blocks)

    def quarantine_handoff(self, request_id: str) -> int:
        """Decode side: end a reserved hand-off whose blocks a transfer may still be writing
        (a READ its transport could not cancel). The request ends aborted; its blocks stay
        held, handed to no one, until :meth:`release_quarantine`. Returns how many."""
        req = self._handoff(request_id, RequestStatus.RESERVED)
        n = self.kv.quarantine(request_id)
        req.status = RequestStatus.FINISHED_ABORTED
        self._aborted.append(self._output(req, [], [], None))
        self._forget(req)
        return n

    def release_quarantine(self, request_id: str) -> None:
        """The transfer into ``request_id``'s quarantined blocks ended: free them."""
        self.kv.release_quarantine(request_id)

    def commit_handoff(self, request_id: str) -> list[RequestOutput]:
        """Decode side: the reserved blocks now hold the prompt's KV; start decoding.

        Returns the output for the first token (already sampled by the prefill engine), which may
        itself finish the request (EOS, a stop condition, ``max_tokens=1``).
        """
        req = self._handoff(request_id, RequestStatus.RESERVED)
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self.scheduler.running.append(req)
        token = req.output_token_ids[-1]
        return [self._on_token(req, token, None)]

    # =============================================================================================
    # Stepping
    # =============================================================================================

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        if not batch:
            self.scheduler.recount()  # a step that only preempted moved requests back
            return outputs
        now = time.monotonic()
        for req in batch.requests:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        sampled = self.runner.execute(batch, self.kv)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.kv.cache_computed_blocks(req)
            if req.request_id in sampled:
                token, lp = sampled[req.request_id]
                req.append_token(token)
                if req.first_token_time is None:
                    req.first_token_time = time.monotonic()
                outputs.append(self._on_token(req, token, lp))
        self.scheduler.recount()
        if not self.scheduler.num_unfinished:
            self.kv.check_integrity()
        return outputs

    def _on_token(self, req: Request, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        status = self._check_stop(req, token)
        new_text = self._update_text(req, token, status)
        if status is None and req.status != RequestStatus.RUNNING:
            status = req.status if req.status.finished else None  # stop string found
        if status is None and req.prefill_only:
            status = RequestStatus.FINISHED_PREFILLED
        handoff = None
        if status is not None:
            pin = status == RequestStatus.FINISHED_PREFILLED
            self.scheduler.finish(req, status, free_blocks=not pin)
            if pin:  # kept, FINISHED_PREFILLED, until release_handoff
                handoff = KVHandoff(req.request_id, self.fingerprint,
                                    tuple(self.kv.block_ids(req.request_id)),
                                    req.num_prompt_tokens, tuple(req.prompt_token_ids), token)
            else:
                self._forget(req)
        out = self._output(req, [token], [lp] if lp else None, new_text)
        out.handoff = handoff
        return out

    def grammars(self) -> Grammars:
        """This engine's structured output: its llguidance tokenizer (~0.2 s for SmolLM2's
        vocabulary), built on first use, or ahead of it by :meth:`warm_grammars` (a worker
        calls that on a thread at start-up, so no engine step waits for it)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer.tk.to_str(),
                                          max(self.model_config.vocab_size,
                                              self.tokenizer.vocab_size),
                                          self.model_config.eos_token_ids
                                          or self.tokenizer.eos_token_ids)
            return self._grammars

    def warm_grammars(self) -> None:
        try:
            self.grammars()
        except Exception as e:  # noqa: BLE001 - a structured request will say it, by name
            log.warning("structured output unavailable for this tokenizer: %s", e)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.matcher is not None and req.matcher.is_stopped():  # the grammar is complete
            return RequestStatus.FINISHED_STOPPED
        if req.num_prior_output + req.num_output_tokens < p.min_tokens:
            # held back by the sampler; only the length limit ends the request before
            return (RequestStatus.FINISHED_LENGTH if req.num_output_tokens >= req.max_tokens
                    else None)
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _update_text(self, req: Request, token: int, status: RequestStatus | None) -> str:
        """Append the token's text; apply stop strings; return the text that may be shown now.

        While a request runs, the last ``len(longest stop string) - 1`` characters are held back,
        so a stop string is never partly streamed before it is recognised and cut.
        """
        st = self._text.get(req.request_id)
        if st is None:
            return ""
        if token not in req.eos_token_ids or req.params.ignore_eos:
            st.text += st.detok.push(token)
        stops = req.params.stop
        if stops and status is None:
            window = max(map(len, stops)) + 1
            for s in stops:
                at = st.text.find(s, max(0, len(st.text) - len(s) - window))
                if at >= 0:
                    st.text = st.text[:at]
                    req.stop_reason = s
                    req.status = RequestStatus.FINISHED_STOPPED
                    status = req.status
                    break
        if status is not None and not st.text.endswith("\ufffd"):
            st.text += "" if req.stop_reason is not None else st.detok.flush()
        hold = 0 if status is not None or not stops else max(map(len, stops)) - 1
        end = max(st.emitted, len(st.text) - hold)
        new, st.emitted = st.text[st.emitted : end], end
        return new

    def _output(self, req, tokens, lps, new_text) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, new_token_ids=tokens, new_text=new_text or "",
            finished=req.is_finished, finish_reason=FINISH_REASONS.get(req.status),
            stop_reason=req.stop_reason, logprobs=lps, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, num_output_tokens=req.num_output_tokens,
            cached_tokens_by_tier=req.cached_tokens_by_tier,
            queue_s=(None if req.first_scheduled_time is None
                     else req.first_scheduled_time - req.arrival_time),
            first_token_s=(None if req.first_token_time is None
                           else req.first_token_time - req.arrival_time))

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._text.pop(req.request_id, None)
        self.runner.generators.pop(req.request_id, None)

    # =============================================================================================
    # Convenience
    # =============================================================================================

    def generate(
        self, prompts: Iterable[str | Sequence[int]], params: SamplingParams | None = None,
        *, chat: bool = False,
    ) -> list[Completion]:
        """Run prompts (text, token-id lists, or chat messages with ``chat=True``) to completion
        in one continuous batch; results come back in input order."""
        order = []
        for p in prompts:
            if chat:
                req = self.add_request(params=params, messages=[{"role": "user", "content": p}])
            elif isinstance(p, str):
                req = self.add_request(p, params)
            else:
                req = self.add_request(params=params, prompt_token_ids=p)
            order.append(req)
        done: dict[str, Completion] = {
            r.request_id: Completion(r.request_id, list(r.prompt_token_ids), [], "", "", 0)
            for r in order}
        while self.has_unfinished():
            for out in self.step():
                c = done[out.request_id]
                c.token_ids += out.new_token_ids
                c.text += out.new_text
                c.logprobs += out.logprobs or []
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.num_cached_tokens = out.num_cached_tokens
                    c.cached_tokens_by_tier = out.cached_tokens_by_tier
        return [done[r.request_id] for r in order]

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        # requests are dataclasses (unhashable): compare their ids
        held = {r.request_id for r in self.scheduler.running} | {
            rid for rid, r in self.requests.items()
            if r.status in (RequestStatus.RESERVED, RequestStatus.FINISHED_PREFILLED)}
        assert set(self.kv.req_blocks) <= held, (
            "blocks held by a request that is neither running, pinned nor reserved")
