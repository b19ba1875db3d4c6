"""KV pool layouts (engine/kv_layout.py) and the tensor-parallel shard rules (engine/tp.py): which
holder slot each reader slot reads for every pair of TP sizes, the descriptor counts per rank
pair, refusals naming both layouts, the kernels on a KV-head-major view, and shards that put
the whole weight back together."""

from __future__ import annotations

import pytest
import torch
from baton.engine import tp
from baton.engine.config import ModelConfig
from baton.engine.kv_layout import KVLayout, LayoutMismatch, chunk_ids
from baton.kernels import cpu_attention
from baton.kernels.paged_attention import decode_attention, gather_kv, store_kv


def layout(heads=8, tp_size=1, kind="head", **kw) -> KVLayout:
    args = dict(num_layers=3, block_size=4, num_kv_heads=heads, head_dim=8, dtype="float32")
    args.update(kw)
    return KVLayout(kind, tp=tp_size, **args)


@pytest.mark.parametrize("heads, p, d", [(8, 1, 2), (8, 2, 1), (8, 2, 2), (2, 1, 4), (2, 4, 2),
                                         (8, 4, 2), (1, 2, 1), (2, 4, 4)])
def test_every_reader_slot_reads_a_holder_slot_of_the_same_head(heads, p, d):
    holder, reader = layout(heads, p), layout(heads, d)
    pairs = reader.read_pairs(holder)
    assert [s for s, _ in pairs] == list(range(len(reader.slots)))
    for ours, theirs in pairs:
        assert reader.slots[ours] == holder.slots[theirs]
    # descriptors per (holder rank, reader rank): the heads that pair shares x the runs
    runs = 3
    counts = reader.descriptors(holder, runs)
    assert sum(counts.values()) == len(reader.slots) * runs
    per_reader_rank = len(reader.slots) // d
    for (_, r), n in counts.items():
        assert n <= per_reader_rank * runs, (r, n)


def test_replicated_heads_are_read_from_each_replica_in_turn():
    holder = layout(2, 4)  # slots hold heads 0 0 1 1
    assert holder.slots == (0, 0, 1, 1)
    reader = layout(2, 4)
    assert reader.read_pairs(holder) == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_pools_that_cannot_map_are_refused_naming_both_layouts():
    block, head = layout(kind="block"), layout(8, 2)
    for reader, holder in ((head, block), (block, head)):
        with pytest.raises(LayoutMismatch) as e:
            reader.read_pairs(holder)
        assert holder.describe() in str(e.value) and reader.describe() in str(e.value)
    with pytest.raises(LayoutMismatch, match="block_size"):
        layout(block_size=8).read_pairs(layout())
    assert layout(kind="block").read_pairs(layout(kind="block")) == [(0, 0)]
    with pytest.raises(ValueError, match="tensor parallelism"):
        layout(kind="block", tp_size=2)
    with pytest.raises(ValueError, match="cannot be split"):
        layout(6, 4)


def test_the_wire_form_round_trips_and_a_garbled_one_is_refused():
    lay = layout(2, 4, dtype="bfloat16")
    assert KVLayout.from_wire(lay.to_wire()) == lay
    with pytest.raises(LayoutMismatch, match="unreadable"):
        KVLayout.from_wire("head:3:4")


def test_chunk_ids_merge_into_one_run_per_slot_pair():
    local, remote = chunk_ids([(0, 1), (1, 3)], [5, 6, 7], [0, 1, 2], local_n=10, remote_n=20)
    assert local == [5, 6, 7, 15, 16, 17] and remote == [20, 21, 22, 60, 61, 62]


def _head_major_pool(heads=4, blocks=6, dtype=torch.float32):
    lay = layout(heads, dtype=str(dtype).removeprefix("torch."))
    storage = torch.randn(lay.storage_shape(blocks)).to(dtype)
    return lay, storage


def test_views_of_a_head_major_pool_are_the_kernels_shape_and_share_its_memory():
    lay, storage = _head_major_pool()
    full = lay.view(storage)
    assert full.shape == (6, 3, 2, 4, 4, 8) and full.stride(5) == 1
    assert full.data_ptr() == storage.data_ptr()
    two = layout(4, 2)
    assert torch.equal(two.view(storage, 1), full[..., 2:, :])
    assert lay.block_nbytes == full[0].nbytes and lay.chunk_nbytes * 4 == lay.block_nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_read_and_write_a_head_major_view_as_a_block_major_pool(dtype):
    lay, storage = _head_major_pool(dtype=dtype)
    view = lay.view(storage)
    plain = view.contiguous()  # the same values, block-major
    ids, offs = torch.tensor([1, 4, 4]), torch.tensor([0, 2, 3])
    k, v = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    store_kv(view, 2, ids, offs, k, v)
    store_kv(plain, 2, ids, offs, k, v)
    assert torch.equal(view, plain)
    table = torch.tensor([[4, 1, 0]])
    for a, b in zip(gather_kv(view, 2, table, torch.float32), gather_kv(plain, 2, table,
                                                                          torch.float32)):
        assert torch.equal(a, b)
    q = torch.randn(2, 8, 8)
    tables, lens = torch.tensor([[4, 1, 0], [2, 3, 5]]), torch.tensor([10, 7])
    want = decode_attention(q, plain, 2, tables, lens, 0.3)
    assert torch.allclose(decode_attention(q, view, 2, tables, lens, 0.3), want, atol=1e-6)
    if cpu_attention.load() is not None:
        got = cpu_attention.decode_attention(q, view, 2, tables, lens, 0.3)
        assert torch.allclose(got, cpu_attention.decode_attention(q, plain, 2, tables, lens,
                                                                  0.3), atol=1e-6)
        assert torch.allclose(got, want, atol=1e-4)


CFG = ModelConfig(arch="qwen3_moe", vocab_size=101, hidden_size=16, intermediate_size=24,
                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4, max_position=64,
                  moe_layers=(0,), num_experts=3, experts_per_token=2, moe_intermediate_size=6)


@pytest.mark.parametrize("name, shape", [
    ("layers.0.qkv", (32, 16)), ("layers.0.qkv_bias", (32,)), ("layers.0.o", (16, 16)),
    ("layers.0.gate_up", (48, 16)), ("layers.0.down", (16, 24)),
    ("layers.0.experts_gate_up", (36, 16)), ("layers.0.experts_down", (48, 6)),
    ("embed", (101, 16)), ("lm_head", (101, 16))])
def test_the_shards_of_every_rank_put_the_weight_back_together(name, shape):
    w = torch.randn(shape)
    parts = [tp.take(w, tp.kept(name, CFG, tp.TPShard(r, 2))) for r in range(2)]
    rule = tp.kept(name, CFG, tp.TPShard(0, 2))
    assert rule is not None
    assert parts[0].shape == tp.kept_shape(shape, rule)
    together = torch.cat(parts, dim=1 if rule[0] == "cols" else 0)
    assert together.shape == w.shape
    assert torch.equal(together.sort(dim=0).values, w.sort(dim=0).values)  # same rows
    assert tp.kept("layers.0.attn_norm", CFG, tp.TPShard(1, 2)) is None


def test_a_rank_keeps_its_query_heads_and_the_kv_heads_they_use():
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=4, num_kv_heads=1, head_dim=2, max_position=8)
    w = torch.arange(12.0)[:, None]  # qkv rows: q 0-7, k 8-9, v 10-11
    for r, q in ((0, [0, 1, 2, 3]), (3, [6, 7])):
        got = tp.take(w, tp.kept("layers.0.qkv", cfg, tp.TPShard(r, 4 if r == 3 else 2)))
        assert got[:, 0].tolist() == [*q, 8, 9, 10, 11]  # the one KV head, replicated


def test_a_model_whose_heads_do_not_split_is_refused_by_field():
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=10, intermediate_size=8,
                      num_layers=1, num_heads=5, num_kv_heads=1, head_dim=2, max_position=8)
    from baton.engine.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="num_attention_heads=5"):
        tp.check_model(cfg, 2)
    with pytest.raises(UnsupportedModelError, match="intermediate_size=6"):
        tp.check_model(ModelConfig(**{**cfg.to_json(), "num_heads": 4, "intermediate_size": 6,
                                      "rope_scaling": cfg.rope_scaling}), 4)
