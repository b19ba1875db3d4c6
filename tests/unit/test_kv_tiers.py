"""KV tiers under the pool: eviction order into and out of each tier (exact hashes and slots),
loads that give the same greedy tokens as a pool hit and as no cache, corrupted and torn disk
slots detected and ignored, a restarted worker's disk tier revalidated or discarded, I/O errors
turning the tier off without failing a request."""

from __future__ import annotations

import os
import struct
from collections import deque

import pytest
import torch
from baton.engine.kv_tiers import (
    _FILE_HEADER,
    _SLOT_HEADER,
    DISK,
    HOST,
    DiskTier,
    HostTier,
    TierStore,
    disk_tier_bytes,
)
from baton.engine.params import SamplingParams

SHAPE = (2, 2, 4, 1, 8)  # one block: [layers, k/v, block_size, kv heads, head_dim]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def h(i: int) -> bytes:
    return bytes([i]) * 32


def block(v: float) -> torch.Tensor:
    return torch.full(SHAPE, float(v))


def disk(tmp_path, n_blocks=3, fingerprint="fp", events=None, **kw) -> DiskTier:
    return DiskTier(str(tmp_path), disk_tier_bytes(n_blocks, torch.empty(SHAPE).nbytes), SHAPE,
                    torch.float32, fingerprint, events, **kw)


def read(tier, hh) -> torch.Tensor | None:
    out = torch.empty(SHAPE)
    return out if tier.read(hh, out) else None


# ---- each tier on its own --------------------------------------------------------------------


def test_host_tier_is_lru_and_hands_its_victims_down():
    ev = deque()
    t = HostTier(2, SHAPE, torch.float32, events=ev)
    assert t.put(h(1), block(1)) == [] and t.put(h(2), block(2)) == []
    assert read(t, h(1))[0, 0, 0, 0, 0] == 1  # a read makes block 1 the most recent
    (victim,) = t.put(h(3), block(3))  # so block 2 goes
    assert victim[0] == h(2) and torch.equal(victim[1], block(2))
    assert list(t.slots) == [h(1), h(3)]
    assert t.put(h(1), block(9)) == []  # held already: refreshed, not rewritten
    assert read(t, h(1))[0, 0, 0, 0, 0] == 1
    assert list(ev) == [("stored:host", h(1)), ("stored:host", h(2)), ("evicted:host", h(2)),
                        ("stored:host", h(3))]
    assert (t.stats.stored, t.stats.evictions, t.stats.blocks) == (3, 1, 2)


def test_disk_tier_lru_slots_and_reads_before_and_after_the_write(tmp_path):
    ev = deque()
    t = disk(tmp_path, events=ev)
    for i in (1, 2, 3):
        t.put(h(i), block(i))
    assert read(t, h(3))[0, 0, 0, 0, 0] == 3  # maybe still pending: served from memory
    t.flush()
    assert not t.pending
    assert [t.slots[h(i)] for i in (1, 2, 3)] == [0, 1, 2]
    assert torch.equal(read(t, h(1)), block(1))  # from the file; block 1 now most recent
    t.put(h(4), block(4))  # evicts block 2 (least recent) and reuses its slot
    t.flush()
    assert list(t.slots) == [h(3), h(1), h(4)] and t.slots[h(4)] == 1
    assert read(t, h(2)) is None and torch.equal(read(t, h(4)), block(4))
    assert ("evicted:disk", h(2)) in ev
    t.close()


def test_a_corrupted_slot_is_detected_and_dropped(tmp_path):
    ev = deque()
    t = disk(tmp_path, events=ev)
    t.put(h(1), block(1))
    t.put(h(2), block(2))
    t.flush()
    with open(t.path, "r+b") as f:  # flip one byte of block 2's KV
        f.seek(_FILE_HEADER + t.slots[h(2)] * t.stride + _SLOT_HEADER + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert read(t, h(2)) is None
    assert t.stats.corrupt == 1 and h(2) not in t and ev[-1] == ("evicted:disk", h(2))
    assert torch.equal(read(t, h(1)), block(1))
    t.close()


def test_restart_revalidates_matching_slots_and_drops_torn_ones(tmp_path):
    t = disk(tmp_path)
    for i in (1, 2, 3):
        t.put(h(i), block(i))
    t.close()
    with open(t.path, "r+b") as f:  # a torn write: block 3's bytes half old, header intact
        f.seek(_FILE_HEADER + 2 * t.stride + _SLOT_HEADER + 8)
        f.write(bytes(64))
    ev = deque()
    again = disk(tmp_path, events=ev)
    assert "revalidated" in again.startup and "2 blocks kept, 1 discarded" in again.startup
    assert list(again.slots) == [h(1), h(2)]  # oldest write first
    assert list(ev) == [("stored:disk", h(1)), ("stored:disk", h(2))]
    assert torch.equal(read(again, h(2)), block(2)) and read(again, h(3)) is None
    again.put(h(4), block(4))  # into the torn block's slot, the only free one
    again.flush()
    assert again.slots[h(4)] == 2
    again.close()


def test_restart_with_another_model_discards_the_file(tmp_path):
    t = disk(tmp_path, fingerprint="model-a")
    t.put(h(1), block(1))
    t.close()
    again = disk(tmp_path, fingerprint="model-b")
    assert again.startup.startswith("discarded") and "model-a" in again.startup
    assert not again.slots and read(again, h(1)) is None
    again.close()


def test_a_write_error_turns_the_tier_off_and_forgets_its_blocks(tmp_path):
    ev = deque()
    errors = []
    t = disk(tmp_path, events=ev, on_error=errors.append)
    t.put(h(1), block(1))
    t.flush()
    os.close(t.fd)  # every later I/O fails with EBADF
    t.fd = os.open(os.devnull, os.O_RDONLY)
    t.put(h(2), block(2))
    t.flush()
    assert not t.stats.enabled and t.stats.errors >= 1 and "write failed" in errors[0]
    t.disable_if_failed()
    assert not t.slots and ev[-1] == ("cleared:disk", None)
    t.put(h(3), block(3))
    assert h(3) not in t and t.stats.dropped == 1
    t.close()


# ---- the store: pool -> host -> disk ----------------------------------------------------------


def test_store_cascades_pool_to_host_to_disk_and_loads_back(tmp_path):
    kv = torch.stack([block(10 + b) for b in range(4)])  # a pool of 4 blocks
    host = HostTier(1, SHAPE, torch.float32)
    dsk = disk(tmp_path)
    store = TierStore(kv, [host, dsk])
    store.offload([0, 1], [h(1), h(2)])  # block 1 then 2 into host: 1 spills to disk
    assert list(host.slots) == [h(2)] and list(dsk.slots) == [h(1)]
    hit = store.lookup([h(1), h(2), h(5)])
    assert hit.hashes == (h(1), h(2)) and hit.tiers == (DISK, HOST)
    kv[2:4] = 0
    assert store.load(hit.hashes, [3, 2]) == [DISK, HOST]
    assert torch.equal(kv[3], block(10)) and torch.equal(kv[2], block(11))
    st = store.stats()
    assert (st[HOST].hits, st[DISK].hits) == (1, 1) and st[DISK].load_bytes == kv[0].nbytes
    store.close()


# ---- through the engine ----------------------------------------------------------------------


def test_hits_from_disk_and_host_give_the_same_tokens_as_the_pool_and_no_cache(tiny_engine,
                                                                             tmp_path):
    prompt = list(range(50, 90)) + [7, 8, 9]  # 10 full blocks of 4, then 3 tokens
    other = list(range(300, 340))  # evicts the prompt's blocks from a 16-block pool
    cold = tiny_engine(enable_prefix_caching=False).generate([prompt], GREEDY)[0]
    pool_eng = tiny_engine()
    pool_eng.generate([prompt], GREEDY)
    warm = pool_eng.generate([prompt], GREEDY)[0]
    assert warm.num_cached_tokens == 40 and warm.token_ids == cold.token_ids

    for cfg in ({"kv_disk_tier_bytes": 1 << 20, "kv_disk_tier_dir": str(tmp_path / "d")},
                {"kv_host_tier_bytes": 1 << 20}):
        eng = tiny_engine(num_kv_blocks=16, **cfg)
        tier = DISK if "kv_disk_tier_bytes" in cfg else HOST
        first = eng.generate([prompt], GREEDY)[0]
        eng.generate([other], GREEDY)
        # the pool kept the prompt's first 4 blocks (freed tail first, evicted tail first)
        hashes = _hashes(eng, prompt)
        assert [eng.kv.pool.get_cached_block(x) is not None for x in hashes] == [True] * 4 + [
            False] * 6
        eng.tiers.flush()
        again = eng.generate([prompt], GREEDY)[0]
        assert again.token_ids == cold.token_ids == first.token_ids
        assert again.num_cached_tokens == 40
        assert again.cached_tokens_by_tier == {"pool": 16, tier: 24}
        assert eng.tiers.stats()[tier].hits * 4 == again.cached_tokens_by_tier[tier]
        eng.check_integrity()
        eng.close()


def test_a_corrupted_disk_block_is_computed_instead(tiny_engine, tmp_path):
    prompt = list(range(50, 90)) + [7, 8, 9]
    cold = tiny_engine(enable_prefix_caching=False).generate([prompt], GREEDY)[0]
    eng = tiny_engine(num_kv_blocks=16, kv_disk_tier_bytes=1 << 20,
                      kv_disk_tier_dir=str(tmp_path))
    eng.generate([prompt], GREEDY)
    eng.generate([list(range(300, 340))], GREEDY)
    eng.tiers.flush()
    dsk = eng.tiers.by_name[DISK]
    first = _hashes(eng, prompt)
    held = [x for x in first if x in dsk]
    assert held, "the prompt's blocks went to disk"
    bad = held[len(held) // 2]
    with open(dsk.path, "r+b") as f:
        f.seek(_FILE_HEADER + dsk.slots[bad] * dsk.stride + _SLOT_HEADER)
        f.write(struct.pack("<f", 1e9))
    again = eng.generate([prompt], GREEDY)[0]
    assert again.token_ids == cold.token_ids
    assert dsk.stats.corrupt == 1 and bad not in dsk
    # reused: the pool's blocks and the disk blocks before the bad one, nothing after it
    assert again.num_cached_tokens == first.index(bad) * 4
    eng.check_integrity()
    eng.close()


def test_a_full_disk_at_start_serves_without_the_tier(tiny_engine, tmp_path, monkeypatch):
    def full(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    eng = tiny_engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    assert eng.tiers is None
    assert eng.generate([[5, 6, 7, 8, 9]], GREEDY)[0].token_ids


def test_tier_flags_are_checked(tiny_engine):
    from baton.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_disk_tier_dir"):
        tiny_engine(kv_disk_tier_bytes=1 << 20)
    with pytest.raises(InvalidRequestError, match="holds no block"):
        tiny_engine(kv_host_tier_bytes=10)


def test_two_engines_on_one_disk_tier_directory_are_refused(tiny_engine, tmp_path):
    from baton.engine.errors import InvalidRequestError

    first = tiny_engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    with pytest.raises(InvalidRequestError, match="kv_disk_tier_dir.*another process"):
        tiny_engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    first.close()


def _hashes(eng, prompt) -> list[bytes]:
    from baton.engine.block_hash import hash_blocks, namespace_for

    return hash_blocks(prompt, eng.cfg.block_size, namespace_for(eng.fingerprint, None))


def test_baton_profile_measures_each_tiers_load(tiny_engine):
    from baton.bench.profile import measure_tiers

    eng = tiny_engine()
    rows = measure_tiers(eng, repeats=1, say=lambda s: None)  # asserts the bytes came back
    assert [r["tier"] for r in rows] == [HOST, DISK]
    for r in rows:
        assert r["blocks"] == 64 and r["bytes"] == 64 * eng.block_nbytes and r["s"] > 0


def test_router_tier_weight_flags(monkeypatch, tmp_path):
    from baton.services.router.routing import DEFAULT_TIER_WEIGHTS, parse_tier_weights
    from baton.services.router.server import resolve_tier_weights

    assert parse_tier_weights("disk=0.5") == {"host": 0.95, "disk": 0.5}
    for bad, why in (("ssd=1", "unknown KV tier 'ssd'"), ("disk=2", "must be in"),
                     ("disk=x", "not name=number")):
        with pytest.raises(ValueError, match=why):
            parse_tier_weights(bad)
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))  # no profile there: the defaults
    assert resolve_tier_weights("auto") == DEFAULT_TIER_WEIGHTS
    assert resolve_tier_weights("host=1") == {"host": 1.0, "disk": 0.8}


def test_a_second_tier_on_the_same_directory_is_refused(tmp_path):
    first = disk(tmp_path)
    with pytest.raises(ValueError, match="another process uses the disk tier"):
        disk(tmp_path)
    first.close()
    disk(tmp_path).close()  # free again once the first is closed


@pytest.mark.gpu
def test_a_gpu_pool_evicts_into_pinned_host_memory_and_disk_and_loads_back(tiny_engine,
                                                                           tmp_path):
    """On CUDA: the pool in VRAM, a pinned host tier of 8 blocks, then disk. The prompt's evicted
    blocks come back from both tiers with the tokens of the CPU engine without a cache (the
    split between the tiers is the one the CPU test below pins)."""
    prompt = list(range(50, 90)) + [7, 8, 9]
    cold = tiny_engine(enable_prefix_caching=False).generate([prompt], GREEDY)[0]
    nbytes = tiny_engine().block_nbytes
    eng = tiny_engine(device="cuda", num_kv_blocks=16, kv_host_tier_bytes=8 * nbytes,
                      kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    host = eng.tiers.by_name[HOST]
    assert host.data.is_pinned() and eng.kv_cache.is_cuda
    first = eng.generate([prompt], GREEDY)[0]
    eng.generate([list(range(300, 340))], GREEDY)
    eng.tiers.flush()
    again = eng.generate([prompt], GREEDY)[0]
    assert first.token_ids == again.token_ids == cold.token_ids
    by = again.cached_tokens_by_tier
    assert by == {"pool": 16, HOST: 8, DISK: 16}
    eng.check_integrity()
    eng.close()


@pytest.mark.parametrize("host_blocks,split", [
    # the allocation before the load evicts more pool blocks into a 2-block host tier, pushing
    # the prompt's two host blocks down to disk: they load from there (the load looks again)
    (2, {"pool": 16, DISK: 24}),
    (8, {"pool": 16, HOST: 8, DISK: 16}),
])
def test_a_host_tier_over_disk_loads_each_block_from_where_it_is(tiny_engine, tmp_path,
                                                                host_blocks, split):
    prompt = list(range(50, 90)) + [7, 8, 9]
    cold = tiny_engine(enable_prefix_caching=False).generate([prompt], GREEDY)[0]
    nbytes = tiny_engine().block_nbytes
    eng = tiny_engine(num_kv_blocks=16, kv_host_tier_bytes=host_blocks * nbytes,
                      kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    eng.generate([prompt], GREEDY)
    eng.generate([list(range(300, 340))], GREEDY)
    eng.tiers.flush()
    again = eng.generate([prompt], GREEDY)[0]
    assert again.token_ids == cold.token_ids
    assert again.cached_tokens_by_tier == split
    st = eng.tiers.stats()
    assert st[HOST].hits * 4 == split.get(HOST, 0) and st[DISK].hits * 4 == split[DISK]
    eng.check_integrity()
    eng.close()
