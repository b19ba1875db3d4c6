"""KV cache tiers below the pool: evicted prefix blocks kept in host memory and on local disk.

When the pool evicts a full, hashed block (``BlockPool.get_new_blocks``), its KV is copied out
before the block is reused and kept by the next tier; a later prompt whose prefix runs past the
pool's hits into a tier gets those blocks loaded back into fresh pool blocks instead of computing
them::

    pool (device) --evict--> host tier (pinned, GPU workers) --evict--> disk tier (one file)
         ^                        |                                          |
         +---- load on a hit -----+-------------- load on a hit -------------+

* Each tier is LRU over whole blocks keyed by their chained hash (``baton.engine.block_hash``).
  LRU, because a block's hash commits to every token before it: a child is never useful without
  its parent, and the pool evicts a request's blocks tail first, so a tier receives children
  before parents and LRU drops them in that order too (an LFU would keep an old conversation's
  popular first blocks whose tails are gone, which no lookup can use past the first miss).
* Tiers are inclusive: a block loaded back stays in its tier, so evicting it from the pool again
  costs no write (``put`` of a hash a tier holds only refreshes its LRU position).
* Host tier: a preallocated (pinned on CUDA) tensor of blocks; ``put`` is a copy.
* Disk tier: one preallocated file of fixed slots, written by a background thread with ``pwrite``
  (not ``mmap``: a full disk or an I/O error is an exception there, not a SIGBUS). A block waiting
  for its write is served from memory. Each slot is ``[header | KV bytes]``; the header holds the
  block hash, a write sequence number, the KV bytes' CRC32 and its own CRC32, and is written after
  the bytes (and zeroed before a slot is rewritten), so a torn or corrupted slot never reads back
  as valid: a load checks both CRCs and the hash, and drops the block on a mismatch. The file's
  own header names the model fingerprint and block size; a restarted worker revalidates every
  slot against it (or discards the file when it does not match) and says which at start-up.
* Any I/O error turns the disk tier off (one log line, ``errors`` counted): requests never fail
  because of a tier.

Events: a tier reports what it gains and loses to the pool's event deque as
``("stored:<tier>", hash)``, ``("evicted:<tier>", hash)`` and ``("cleared:<tier>", None)``, which
the prefix-index publisher turns into one Redis set per tier.

Threads: everything here runs on the engine thread except the disk tier's writer (its queue and
``pending`` map are shared under a lock).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger("baton.engine.tiers")

HOST, DISK = "host", "disk"
TIERS = (HOST, DISK)


def stored_event(tier: str) -> str:
    return f"stored:{tier}"


def evicted_event(tier: str) -> str:
    return f"evicted:{tier}"


def cleared_event(tier: str) -> str:
    return f"cleared:{tier}"


@dataclass
class TierStats:
    """Counters of one tier (``baton status``, ``/metrics``)."""

    capacity: int = 0  # blocks
    blocks: int = 0  # blocks held now
    stored: int = 0  # blocks written into it
    hits: int = 0  # blocks loaded back into the pool
    loads: int = 0  # load operations (one per request's run of blocks)
    load_bytes: int = 0
    load_s: float = 0.0
    evictions: int = 0
    errors: int = 0  # I/O errors (the disk tier turns off on the first)
    corrupt: int = 0  # blocks whose checksum or hash did not match on a load
    dropped: int = 0  # blocks not stored because the writer was behind or the tier is off
    enabled: bool = True

    @property
    def load_bandwidth(self) -> float:
        return self.load_bytes / self.load_s if self.load_s > 0 else 0.0


class Tier:
    """One tier of blocks keyed by hash, LRU. Used from the engine thread.

    ``put(h, block)`` stores a copy of ``block`` (a CPU tensor of one block's KV, which the caller
    will not touch again) and returns the hashes evicted to make room with their data, for the
    next tier; ``read(h, out)`` fills ``out`` (CPU) and returns False when the block is not (or no
    longer validly) here. ``events`` is the pool's event deque or None.
    """

    name: str

    def __contains__(self, h: bytes) -> bool:
        raise NotImplementedError

    def put(self, h: bytes, block: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        raise NotImplementedError

    def read(self, h: bytes, out: torch.Tensor) -> bool:
        raise NotImplementedError

    def touch(self, h: bytes) -> None:
        """Mark a held block most recently used."""
        self.slots.move_to_end(h)

    def close(self) -> None:
        pass


class HostTier(Tier):
    """``num_blocks`` blocks of host memory (pinned when ``pin``), LRU."""

    name = HOST

    def __init__(self, num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype,
                 pin: bool = False, events=None) -> None:
        assert num_blocks > 0, num_blocks
        # data: [num_blocks, *block_shape]
        self.data = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.free = list(range(num_blocks - 1, -1, -1))
        self.events = events
        self.stats = TierStats(capacity=num_blocks)

    def __contains__(self, h: bytes) -> bool:
        return h in self.slots

    def put(self, h, block):
        if h in self.slots:
            self.slots.move_to_end(h)
            return []
        out = []
        if not self.free:
            old, slot = self.slots.popitem(last=False)
            out.append((old, self.data[slot].clone()))
            self.free.append(slot)
            self.stats.evictions += 1
            self._event(evicted_event(HOST), old)
        slot = self.free.pop()
        self.data[slot].copy_(block)
        self.slots[h] = slot
        self.stats.stored += 1
        self.stats.blocks = len(self.slots)
        self._event(stored_event(HOST), h)
        return out

    def read(self, h, out):
        slot = self.slots.get(h)
        if slot is None:
            return False
        out.copy_(self.data[slot])
        self.slots.move_to_end(h)
        return True

    def _event(self, kind: str, h: bytes) -> None:
        if self.events is not None:
            self.events.append((kind, h))


# ---- disk ----------------------------------------------------------------------------------------

_FILE_MAGIC = b"BATONKVT"
_FILE_VERSION = 1
_FILE_HEADER = 4096  # the file's header: magic, version, JSON (fingerprint, sizes), CRC32
_SLOT_MAGIC = b"BKV1"
# slot header: magic, write sequence, block hash, KV bytes' length and CRC32, the header's CRC32
_SLOT = struct.Struct("<4sQ32sII")
_SLOT_HEADER = 64
_ALIGN = 4096


def slot_stride(block_nbytes: int) -> int:
    """Bytes one disk-tier slot takes: its header and the block, rounded up to 4 KiB."""
    return -(-(_SLOT_HEADER + block_nbytes) // _ALIGN) * _ALIGN


def disk_tier_bytes(num_blocks: int, block_nbytes: int) -> int:
    """The disk-tier size (``kv_disk_tier_bytes``) that holds ``num_blocks`` blocks."""
    return num_blocks * slot_stride(block_nbytes)


class DiskTierBusy(ValueError):
    """Another process holds the disk tier's directory."""


class DiskTier(Tier):
    """Fixed slots in one preallocated file under ``directory``, written by a background thread.

    ``max_pending`` bounds the blocks waiting for the writer; past it, ``put`` drops the block
    (counted in ``dropped``) rather than slow the engine's step.
    """

    name = DISK

    def __init__(self, directory: str, capacity_bytes: int, block_shape: Sequence[int],
                 dtype: torch.dtype, fingerprint: str, events=None, max_pending: int = 256,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self.nbytes = torch.empty(block_shape, dtype=dtype).nbytes
        self.stride = slot_stride(self.nbytes)
        self.num_slots = max(0, capacity_bytes // self.stride)
        self.events, self.max_pending, self.on_error = events, max_pending, on_error
        self.stats = TierStats(capacity=self.num_slots)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.free: list[int] = []
        self.pending: dict[bytes, torch.Tensor] = {}  # written soon; read from here meanwhile
        self._lock = threading.Lock()
        self._seq = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.path = os.path.join(directory, "kv-tier.bin")
        self.meta = {"fingerprint": fingerprint, "block_nbytes": self.nbytes,
                     "block_shape": list(self.block_shape), "dtype": str(dtype).split(".")[-1],
                     "slot_stride": self.stride, "num_slots": self.num_slots}
        self.fd = -1
        self.startup = ""  # what happened to an existing file: revalidated or discarded, and why
        if self.num_slots == 0:
            raise ValueError(f"disk tier of {capacity_bytes} bytes holds no block of "
                             f"{self.nbytes} bytes")
        os.makedirs(directory, exist_ok=True)
        # one worker per directory: a second one would overwrite the first one's slots
        self._lock_fd = os.open(os.path.join(directory, "kv-tier.lock"), os.O_RDWR | os.O_CREAT,
                                0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise DiskTierBusy(f"another process uses the disk tier in {directory}: give each "
                               "worker its own --kv-disk-tier-dir") from None
        try:
            self._open()
        except OSError:
            os.close(self._lock_fd)
            raise
        self._thread = threading.Thread(target=self._writer, name="kv-disk-tier", daemon=True)
        self._thread.start()

    # ---- start-up: revalidate or discard ------------------------------------------------------

    def _open(self) -> None:
        reason = self._read_file_header()
        if reason is None:
            self.fd = os.open(self.path, os.O_RDWR)
            kept, bad = self._revalidate()
            self.startup = (f"revalidated {self.path}: {kept} blocks kept, {bad} discarded "
                            f"(checksum or header mismatch)")
        else:
            self.startup = f"discarded {self.path}: {reason}" if reason != "absent" else \
                f"created {self.path}"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            size = _FILE_HEADER + self.num_slots * self.stride
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as e:  # a full disk: the tier is off from the start
                os.close(self.fd)
                self.fd = -1
                raise OSError(e.errno, f"cannot allocate {size} bytes for the disk tier at "
                                       f"{self.path}: {e.strerror}") from None
            body = json.dumps(self.meta, sort_keys=True).encode()
            head = _FILE_MAGIC + struct.pack("<II", _FILE_VERSION, len(body)) + body
            os.pwrite(self.fd, head + struct.pack("<I", zlib.crc32(head)), 0)
            self.free = list(range(self.num_slots - 1, -1, -1))
        log.info("KV disk tier: %s", self.startup)

    def _read_file_header(self) -> str | None:
        """None when the existing file matches this model and layout; else why not."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(_FILE_HEADER)
        except FileNotFoundError:
            return "absent"
        except OSError as e:
            return f"unreadable ({e})"
        if len(head) < 16 or head[:8] != _FILE_MAGIC:
            return "not a Baton KV tier file"
        version, n = struct.unpack_from("<II", head, 8)
        if version != _FILE_VERSION or 16 + n + 4 > len(head):
            return f"file version {version}, this Baton writes {_FILE_VERSION}"
        (crc,) = struct.unpack_from("<I", head, 16 + n)
        if crc != zlib.crc32(head[: 16 + n]):
            return "its header's checksum does not match"
        try:
            meta = json.loads(head[16 : 16 + n])
        except ValueError:
            return "its header is not JSON"
        if meta.get("fingerprint") != self.meta["fingerprint"]:
            return (f"written for model fingerprint {meta.get('fingerprint')}, this worker has "
                    f"{self.meta['fingerprint']}")
        if meta != self.meta:
            return "written with another block layout or size"
        if os.path.getsize(self.path) < _FILE_HEADER + self.num_slots * self.stride:
            return "shorter than its slots"
        return None

    def _revalidate(self) -> tuple[int, int]:
        """Read every slot; keep those whose header and KV checksums match (oldest write first
        in the LRU order)."""
        found: list[tuple[int, bytes, int]] = []
        bad = 0
        buf = bytearray(self.stride)
        for slot in range(self.num_slots):
            n = os.preadv(self.fd, [buf], self._offset(slot))
            h = self._check(memoryview(buf)[:n], None)
            if h is None:
                bad += buf[:4] == _SLOT_MAGIC
                continue
            seq = _SLOT.unpack_from(buf)[1]
            found.append((seq, h, slot))
        found.sort()
        used = set()
        for seq, h, slot in found:
            if h in self.slots:  # the same block twice: keep the newer slot
                used.discard(self.slots.pop(h))
            self.slots[h] = slot
            used.add(slot)
            self._seq = max(self._seq, seq)
        self.free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
        self.stats.blocks = len(self.slots)
        for h in self.slots:
            self._event(stored_event(DISK), h)
        return len(self.slots), bad

    def _offset(self, slot: int) -> int:
        return _FILE_HEADER + slot * self.stride

    def _check(self, raw: memoryview, want: bytes | None) -> bytes | None:
        """The slot's block hash if ``raw`` (header + KV bytes) is intact (and is ``want``)."""
        if len(raw) < _SLOT_HEADER + self.nbytes:
            return None
        magic, _seq, h, n, crc = _SLOT.unpack_from(raw)
        (hcrc,) = struct.unpack_from("<I", raw, _SLOT.size)
        if magic != _SLOT_MAGIC or hcrc != zlib.crc32(raw[: _SLOT.size]) or n != self.nbytes:
            return None
        if want is not None and h != want:
            return None
        if zlib.crc32(raw[_SLOT_HEADER : _SLOT_HEADER + n]) != crc:
            return None
        return h

    # ---- the engine thread's side -------------------------------------------------------------

    def __contains__(self, h: bytes) -> bool:
        return h in self.slots

    def put(self, h, block):
        assert block.dtype == self.dtype and block.shape == self.block_shape, block.shape
        if not self.stats.enabled:
            self.stats.dropped += 1
            return []
        if h in self.slots:
            self.slots.move_to_end(h)
            return []
        with self._lock:
            if len(self.pending) >= self.max_pending:
                self.stats.dropped += 1
                return []
        if not self.free:
            old, slot = self.slots.popitem(last=False)
            self.free.append(slot)
            self.stats.evictions += 1
            self._event(evicted_event(DISK), old)
        slot = self.free.pop()
        self.slots[h] = slot
        self._seq += 1
        with self._lock:
            self.pending[h] = block
        self._queue.put((slot, h, block, self._seq))
        self.stats.stored += 1
        self.stats.blocks = len(self.slots)
        self._event(stored_event(DISK), h)
        return []

    def read(self, h, out):
        slot = self.slots.get(h)
        if slot is None:
            return False
        with self._lock:
            block = self.pending.get(h)
        if block is not None:
            out.copy_(block)
        else:
            buf = bytearray(self.stride)
            try:
                n = os.preadv(self.fd, [buf], self._offset(slot))
            except OSError as e:
                self._fail(f"read failed: {e}")
                return False
            raw = memoryview(buf)[:n]
            if self._check(raw, h) is None:
                log.warning("KV disk tier: block %s in slot %d failed its checksum; dropped",
                            h.hex()[:16], slot)
                self.stats.corrupt += 1
                self._drop(h)
                return False
            out.copy_(torch.frombuffer(raw[_SLOT_HEADER : _SLOT_HEADER + self.nbytes],
                                       dtype=self.dtype).view(self.block_shape))
        self.slots.move_to_end(h)
        return True

    def _drop(self, h: bytes) -> None:
        slot = self.slots.pop(h, None)
        if slot is not None:
            self.free.append(slot)
            self.stats.blocks = len(self.slots)
            self._event(evicted_event(DISK), h)

    def _fail(self, why: str) -> None:
        """An I/O error: the tier is off from now on (the engine thread clears its index)."""
        if self.stats.enabled:
            self.stats.enabled = False
            self.stats.errors += 1
            log.error("KV disk tier off: %s (requests go on without it)", why)
            if self.on_error is not None:
                self.on_error(why)

    def disable_if_failed(self) -> None:
        """Engine thread: after the writer failed, forget every block (the index follows)."""
        if not self.stats.enabled and self.slots:
            self.slots.clear()
            self.free.clear()
            self.stats.blocks = 0
            self._event(cleared_event(DISK), None)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (tests, benchmarks, shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    # ---- the writer thread --------------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            slot, h, block, seq = item
            try:
                if self.stats.enabled:
                    self._write(slot, h, block, seq)
            except OSError as e:
                self.stats.errors += 1
                self._fail(f"write failed: {e}")
            finally:
                with self._lock:
                    if self.pending.get(h) is block:
                        del self.pending[h]

    def _write(self, slot: int, h: bytes, block: torch.Tensor, seq: int) -> None:
        off = self._offset(slot)
        data = memoryview(block.contiguous().view(torch.uint8).numpy()).cast("B")
        os.pwrite(self.fd, bytes(_SLOT_HEADER), off)  # invalid until the bytes are down
        if os.pwrite(self.fd, data, off + _SLOT_HEADER) != self.nbytes:
            raise OSError(28, "short write (disk full?)")
        head = _SLOT.pack(_SLOT_MAGIC, seq, h, self.nbytes, zlib.crc32(data))
        os.pwrite(self.fd, head + struct.pack("<I", zlib.crc32(head)), off)

    def _event(self, kind: str, h: bytes | None) -> None:
        if self.events is not None:
            self.events.append((kind, h))

    def close(self) -> None:
        """Write what is queued, stop the writer, close the file (safe to call twice)."""
        if self._thread.is_alive():
            self.flush()
            self._queue.put(None)
            self._thread.join(5)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


# ---- the store the engine uses -----------------------------------------------------------------


@dataclass(frozen=True)
class TierHit:
    """Blocks past the pool's prefix hits that a tier holds: ``tiers[i]`` has ``hashes[i]``."""

    hashes: tuple[bytes, ...] = ()
    tiers: tuple[str, ...] = ()


class TierStore:
    """The tiers under one pool, and the copies between them and the pool's KV tensor.

    ``kv`` is the pool's tensor, block-major (``kv[b]`` is block b); ``offload`` must be called
    with evicted blocks before anything overwrites them.
    """

    def __init__(self, kv: torch.Tensor, tiers: Sequence[Tier]) -> None:
        self.kv = kv
        self.tiers = list(tiers)
        self.by_name = {t.name: t for t in self.tiers}

    def offload(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """Copy evicted pool blocks into the first tier (its evictions cascade down)."""
        if not block_ids or not self.tiers:
            return
        for t in self.tiers:
            if isinstance(t, DiskTier):
                t.disable_if_failed()
        todo = []
        for i, h in enumerate(hashes):
            held = [t for t in self.tiers if h in t]
            for t in held:  # a block some tier holds already: refresh its LRU position, no copy
                t.touch(h)
            if not held:
                todo.append((h, i))
        if not todo:
            return
        # one gather (and on CUDA one device-to-host copy) for the step's evictions
        ids = torch.tensor([block_ids[i] for _, i in todo], device=self.kv.device)
        data = self.kv.index_select(0, ids).to("cpu")
        for (h, _), block in zip(todo, data):
            spill = [(h, block)]
            for t in self.tiers:
                nxt = []
                for hh, bb in spill:
                    nxt += t.put(hh, bb)
                spill = nxt
                if not spill:
                    break

    def lookup(self, hashes: Sequence[bytes]) -> TierHit:
        """The leading run of ``hashes`` some tier holds (the fastest tier named per block).
        The run becomes its tiers' most recently used: the allocation that precedes its load
        evicts pool blocks into the tiers, and those should push out something else."""
        hs, ts = [], []
        for h in hashes:
            t = next((t for t in self.tiers if h in t), None)
            if t is None:
                break
            t.touch(h)
            hs.append(h)
            ts.append(t.name)
        return TierHit(tuple(hs), tuple(ts))

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> list[str]:
        """Fill pool block ``block_ids[i]`` with ``hashes[i]`` from whichever tier holds it now
        (a block :meth:`lookup` found in the host tier may have moved to disk since), in one
        batched copy into the pool. Returns the tier of each leading block loaded: fewer than
        asked when one is gone or fails its check."""
        n = len(hashes)
        if n == 0:
            return []
        t0 = time.perf_counter()
        staging = torch.empty((n, *self.kv.shape[1:]), dtype=self.kv.dtype)
        got: list[str] = []
        for i, h in enumerate(hashes):
            tier = next((t for t in self.tiers if h in t), None)
            if tier is None or not tier.read(h, staging[i]):
                break
            got.append(tier.name)
        ok = len(got)
        if ok:
            ids = torch.tensor(list(block_ids[:ok]), device=self.kv.device)
            self.kv.index_copy_(0, ids, staging[:ok].to(self.kv.device, non_blocking=True))
            dt = time.perf_counter() - t0
            per = staging[0].nbytes
            for name in set(got):
                s = self.by_name[name].stats
                k = got.count(name)
                s.hits += k
                s.loads += 1
                s.load_bytes += k * per
                s.load_s += dt * k / ok
        return got

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats for t in self.tiers}

    def flush(self) -> None:
        for t in self.tiers:
            if isinstance(t, DiskTier):
                t.flush()

    def close(self) -> None:
        for t in self.tiers:
            t.close()
