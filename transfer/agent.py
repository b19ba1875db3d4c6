"""One NIXL agent per worker, with the engine's whole KV pool registered once at start-up.

A pool is ``slots x num_blocks`` chunks (``engine/kv_layout.py``): chunk ``s * num_blocks + b``,
slot ``s``'s part of block ``b``, is the region ``[base + i * chunk_nbytes, + chunk_nbytes)``.
Both sides prepare one descriptor list over all chunks once per peer, and a hand-off is a READ
of index lists: for each of the reader's slots, the holder's slot with the same KV head, block
by block (NIXL merges runs of consecutive ids into one region). A block-major pool has one slot.

UCX picks its transports itself (on one machine: ``cma`` for DRAM, i.e. one ``process_vm_readv``
per region, or ``cuda_ipc`` for VRAM: the reader's GPU copies straight out of the holder's pool;
across nodes, RDMA where UCX finds it).

A pool on a GPU is registered as VRAM. Where that fails (a UCX without CUDA support, a driver
that refuses the registration) or where ``staging="always"`` asks for it, the agent registers a
pinned host mirror of the pool instead and stages each hand-off through it: the holder copies
the leased blocks device -> host before it hands out their handle (:meth:`KVAgent.stage_out`),
the reader READs host to host and copies host -> device (:meth:`KVAgent.read`). It says so:
``memory`` names it, :meth:`KVAgent.transports` starts with ``staged-host``, and
``staged_bytes`` counts the copies (``baton_kv_staged_bytes`` on /metrics).

Which transports UCX actually used is read back from its own protocol
report (``UCX_PROTO_INFO``), which the agent turns on and sends to a log file it parses; that is
how a silent fall back to TCP shows up in worker info instead of only in the bandwidth.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from baton.engine.kv_layout import KVLayout, LayoutMismatch, chunk_ids
from baton.transfer.errors import (
    FingerprintMismatchError,
    PeerUnavailableError,
    ReadInFlightError,
    TransferDeadlineError,
    TransferError,
)

from baton import LOG_DIR_ENV

log = logging.getLogger("baton.transfer")

_LOCAL = "NIXL_INIT_AGENT"
# auto: VRAM pools registered as such, staged only where NIXL refuses them; always: every pool
# staged through a host mirror (a GPU whose VRAM UCX moves badly; tests on CPU); never: refuse
# to start rather than stage
STAGING = ("auto", "always", "never")
_libc = ctypes.CDLL(None)
_READ_TITLE = re.compile(r"remote memory read by")
_ROW = re.compile(r"\|\s*\d+(?:\.\.(?:\d+|inf))?\s*\|[^|]*\|([^|]*)\|")  # range | how | config
_TRANSPORT = re.compile(r"\b([a-z][\w]*/[\w:.-]+)")  # cma/memory, tcp/lo, rc_mlx5/mlx5_0:1


def configure_ucx(log_dir: str | os.PathLike | None = None,
                  loopback_only: bool = False) -> Path | None:
    """Ask UCX to report its protocol choices into a per-process log file. Must run before the
    first agent is created (UCX reads its environment once). Returns the log path, or None if
    the user set ``UCX_LOG_FILE`` themselves (then transports are reported as unknown).

    ``loopback_only`` (a worker that serves on a loopback address): UCX uses the loopback
    device only (``UCX_NET_DEVICES=lo`` unless set), so it opens no listening socket on the
    machine's other interfaces; shared memory and CMA still carry the KV blocks.

    The log goes into ``log_dir``, else the folder of the process's own logs that its launcher
    named (``$BATON_LOG_DIR``: a worker's log folder, kept or removed with its log), else the
    temporary folder; the agent removes it when it closes."""
    if loopback_only:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    # UCX turns cuda_ipc GETs (our READs of another process's VRAM) off unless the GPU has
    # NVLink peers, and then moves VRAM over TCP at ~0.5 GB/s; two processes on one GPU or on
    # PCIe-connected GPUs copy far faster with them on (H100, same GPU: ~950 GB/s vs 0.5)
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    if "UCX_LOG_FILE" in os.environ and "BATON_UCX_LOG" not in os.environ:
        return None
    d = Path(log_dir or os.environ.get(LOG_DIR_ENV) or tempfile.gettempdir())
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"baton-ucx.{os.getpid()}.log"
    os.environ["UCX_PROTO_INFO"] = "y"
    os.environ["UCX_LOG_FILE"] = str(path)
    os.environ["BATON_UCX_LOG"] = str(path)
    return path


class _TransportLog:
    """Reads the READ protocol tables UCX appends to its log, rows like
    ``| 0..inf | zero-copy | cma/memory |`` or ``| 0..inf | zero-copy | 52% on tcp/lo and 48% on
    tcp/eth0 |``."""

    def __init__(self, path: Path | None) -> None:
        self.path, self._offset, self.seen = path, 0, set()

    def poll(self) -> list[str]:
        if self.path is None or not self.path.exists():
            return sorted(self.seen)
        _libc.fflush(None)  # UCX writes its log through a buffered FILE*
        with open(self.path, errors="replace") as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        in_rma = False
        for line in text.splitlines():
            if "|" not in line:
                continue
            if _READ_TITLE.search(line):
                in_rma = True
            elif " by " in line and "from" in line:  # another table's title
                in_rma = False
            elif in_rma and (m := _ROW.search(line)):
                self.seen.update(_TRANSPORT.findall(m.group(1)))
        return sorted(self.seen)


class KVAgent:
    """The worker's NIXL agent and its registered KV pool: ``kv`` is the pool's storage as
    ``layout`` lays it out (``kv_layout.KVLayout``); without a layout, ``kv: [num_blocks, ...]``
    with one chunk per block (tests and benchmarks that move plain tensors). ``self.kv`` is the
    ``[num_blocks, ...]`` view of every slot either way.

    Thread-safe (NIXL's strict sync mode): reads for different requests may run concurrently.
    ``read`` writes only the given local blocks; the caller owns them (reserved, not scheduled).
    """

    def __init__(self, name: str, kv: torch.Tensor, num_threads: int = 0,
                 progress_interval_s: float = 0.002, idle_interval_s: float = 0.064,
                 staging: str = "auto", layout: KVLayout | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        assert kv.is_contiguous(), "the KV pool must be one contiguous tensor"
        if staging not in STAGING:
            raise ValueError(f"staging={staging!r}: must be one of {STAGING}")
        self.name, self.layout = name, layout
        self.kv = kv if layout is None else layout.view(kv)
        self.num_blocks = kv.shape[0] if layout is None else layout.num_blocks(kv)
        self.num_slots = 1 if layout is None else len(layout.slots)
        self.chunk_nbytes = kv.nbytes // (self.num_blocks * self.num_slots)
        self.block_nbytes = self.chunk_nbytes * self.num_slots
        self.host: torch.Tensor | None = None  # the pinned mirror, when staged
        self.host_view: torch.Tensor | None = None  # and its [num_blocks, ...] view
        self.staged_bytes = 0  # bytes copied between the pool and the mirror
        self._stream = None  # the staging copies' CUDA stream
        self.ucx_tls = os.environ.get("UCX_TLS", "")
        ucx_log = os.environ.get("BATON_UCX_LOG")
        self._transports = _TransportLog(Path(ucx_log) if ucx_log else None)
        # No NIXL progress thread: it busy-polls a core per process, which on a small machine
        # starves the engine. A reader progresses its own reads while it waits for them; the
        # holder of one-sided READs only answers connection set-up. A thread of ours does that:
        # every ``progress_interval_s`` after ``wake()`` (a reader's handshake, a lease grant:
        # a read, maybe from a new peer, is coming), backing off to ``idle_interval_s``. Waking
        # every 2 ms for good cost a loaded worker's engine 5-6% (a GIL hand-over and a context
        # switch on the engine's core 500 times a second).
        conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                 num_threads=num_threads,
                                 sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = nixl_agent(name, conf)
        if "UCX" not in self.agent.backends:
            raise TransferError("NIXL has no UCX backend here; cannot move KV blocks")
        self._reg = self._register(kv, staging)
        self._local = self.agent.prep_xfer_dlist(
            _LOCAL, self._blocks(self.base, self.chunk_nbytes, self.num_slots * self.num_blocks,
                                 self.device_id), self.mem_type)
        self._remote: dict[str, object] = {}  # peer agent name -> prepped descriptor list
        # peer agent name -> (slot pairs, the peer's blocks): how our chunks map to theirs
        self._plans: dict[str, tuple[list[tuple[int, int]], int]] = {}
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._progress_interval_s, self._idle_interval_s = progress_interval_s, idle_interval_s
        threading.Thread(target=self._progress_loop, name="nixl-progress", daemon=True).start()
        log.info("NIXL agent %s: %d KV blocks of %d bytes registered (%s), UCX_TLS=%s",
                 name, self.num_blocks, self.block_nbytes, self.memory, self.ucx_tls or "default")

    def _register(self, kv: torch.Tensor, staging: str):
        """Register the pool (VRAM or DRAM), or its pinned host mirror when staging; sets
        ``base``, ``mem_type``, ``device_id`` and ``memory``."""
        if not kv.is_cuda and staging != "always":
            self.base, self.mem_type, self.device_id, self.memory = kv.data_ptr(), "DRAM", 0, "DRAM"
            return self.agent.register_memory([kv])
        if staging != "always":
            try:
                reg = self.agent.register_memory([kv])
            except Exception as e:  # noqa: BLE001 - any refusal means: stage (or stop)
                if staging == "never":
                    raise TransferError(f"NIXL could not register the KV pool on {kv.device} "
                                        f"as VRAM ({type(e).__name__}: {e}) and staging is "
                                        f"off") from e
                log.warning("NIXL could not register the KV pool on %s as VRAM (%s: %s); "
                            "hand-offs stage through pinned host memory", kv.device,
                            type(e).__name__, e)
            else:
                self.base, self.mem_type = kv.data_ptr(), "VRAM"
                self.device_id, self.memory = kv.device.index or 0, "VRAM"
                return reg
        # a mirror of the whole pool: any block may be leased or read
        self.host = (torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True) if kv.is_cuda
                     else torch.zeros_like(kv))
        self.host_view = self.host if self.layout is None else self.layout.view(self.host)
        self.base, self.mem_type, self.device_id = self.host.data_ptr(), "DRAM", 0
        self.memory = ("VRAM staged through pinned host memory" if kv.is_cuda
                       else "DRAM staged through a host mirror")
        if kv.is_cuda:
            self._stream = torch.cuda.Stream(kv.device)
        return self.agent.register_memory([self.host])

    @property
    def staged(self) -> bool:
        return self.host is not None

    def stage_out(self, block_ids) -> None:
        """Staged pools: copy ``block_ids`` pool -> mirror, before readers may READ them. The
        blocks were computed by a finished engine step (its outputs were read back, so its
        kernels completed) and stay pinned by their lease, so nothing writes them meanwhile."""
        if self.host is not None:
            self._copy(self.host_view, self.kv, block_ids)

    def _stage_in(self, block_ids) -> None:
        self._copy(self.kv, self.host_view, block_ids)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, block_ids) -> None:
        """dst[b] = src[b] for each block (every slot), one copy per run of consecutive ids:
        one region per run in a block-major pool, one per (slot, run) in a head-major one."""
        runs = _runs(block_ids)
        if self._stream is None:
            for a, b in runs:
                dst[a:b].copy_(src[a:b])
        else:
            with torch.cuda.stream(self._stream):
                for a, b in runs:
                    dst[a:b].copy_(src[a:b], non_blocking=True)
            self._stream.synchronize()
        self.staged_bytes += len(block_ids) * self.block_nbytes

    @staticmethod
    def _blocks(base: int, nbytes: int, count: int, dev: int) -> np.ndarray:
        # [count, 3]: (address, length, device id) per block
        descs = np.empty((count, 3), dtype=np.uint64)
        descs[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(nbytes)
        descs[:, 1] = nbytes
        descs[:, 2] = dev
        return descs

    def wake(self) -> None:
        """A peer may need answers soon (it is connecting, or about to read): progress UCX at
        the fast interval again, then back off."""
        self._wake.set()

    def _progress_loop(self) -> None:
        interval = self._progress_interval_s
        while True:
            woken = self._wake.wait(interval)
            if self._closed.is_set():
                return
            if woken:
                self._wake.clear()
            # progresses UCX: answers peers' connection set-up
            if self.agent.get_new_notifs() or woken:
                interval = self._progress_interval_s
            else:
                interval = min(2 * interval, self._idle_interval_s)

    def block_crc32(self, block_ids) -> tuple[int, ...]:
        """CRC32 of each block's KV, one replica of each head in head order: pools of any TP
        size holding the same KV agree (a debugging option; a GPU pool's blocks go to the host
        for it)."""
        import zlib

        heads = None
        if self.layout is not None and self.layout.kind == "head":
            first: dict[int, int] = {}
            for s, h in enumerate(self.layout.slots):
                first.setdefault(h, s)
            heads = torch.tensor([first[h] for h in sorted(first)], device=self.kv.device)
        out = []
        for b in block_ids:
            blk = self.kv[int(b)] if heads is None else self.kv[int(b)].index_select(3, heads)
            out.append(zlib.crc32(blk.contiguous().view(torch.uint8).cpu().numpy()))
        return tuple(out)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def transports(self) -> str:
        """UCX transports the RMA protocols were set up over so far, e.g. ``cma/memory`` or
        ``cuda_ipc/cuda``; a staged pool's start with ``staged-host``."""
        seen = self._transports.poll()
        return ",".join((["staged-host"] if self.staged else []) + seen)

    # ---- peers ---------------------------------------------------------------------------------

    def add_peer(self, metadata: bytes, base: int, block_nbytes: int, num_blocks: int,
                 mem_type: str = "DRAM", device_id: int = 0, layout: str = "") -> str:
        """Prepare READs from a peer's pool. ``layout`` (its ``to_wire``; "" from a peer without
        one: one chunk per block) must map onto ours, else :class:`FingerprintMismatchError`
        naming both layouts, before anything is registered."""
        pairs, chunk = self.plan(layout, block_nbytes)
        name = self.agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        self._drop_dlist(name)
        self._remote[name] = self.agent.prep_xfer_dlist(
            name, self._blocks(base, chunk, (block_nbytes // chunk) * num_blocks, device_id),
            mem_type or "DRAM")
        self._plans[name] = (pairs, num_blocks)
        return name

    def plan(self, layout: str, block_nbytes: int) -> tuple[list[tuple[int, int]], int]:
        """(our slot, their slot) pairs and their chunk size for a peer of ``layout``."""
        if self.layout is not None and layout:
            try:
                theirs = KVLayout.from_wire(layout)
                return self.layout.read_pairs(theirs), theirs.chunk_nbytes
            except LayoutMismatch as e:
                raise FingerprintMismatchError("", "", "peer", str(e)) from e
        if block_nbytes != self.block_nbytes or self.num_slots != 1:
            raise FingerprintMismatchError(
                "", "", "peer", f"KV layouts do not map: peer blocks are {block_nbytes} bytes "
                f"{layout if layout else '(no layout given)'}, ours {self.block_nbytes} "
                f"({self.layout.describe() if self.layout else 'no layout'})")
        return [(0, 0)], block_nbytes

    def remove_peer(self, name: str) -> None:
        self._drop_dlist(name)
        self._plans.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:  # already gone on NIXL's side; nothing of ours to free
            log.debug("remove_remote_agent(%s): %s", name, e)

    def _drop_dlist(self, name: str) -> None:
        old = self._remote.pop(name, None)
        if old is not None:
            self.agent.release_dlist_handle(old)

    # ---- transfer ------------------------------------------------------------------------------

    def read(self, peer: str, remote_ids: list[int], local_ids: list[int], deadline: float) -> None:
        """READ the peer's blocks ``remote_ids`` into our ``local_ids``; returns when the bytes are
        in. Raises :class:`PeerUnavailableError` if the peer is gone, :class:`TransferDeadlineError`
        past ``deadline`` (``time.monotonic()``), and :class:`ReadInFlightError` past it when
        NIXL cannot cancel the READ (``local_ids`` may still be written: see its ``read``)."""
        assert len(remote_ids) == len(local_ids)
        if not remote_ids:
            return
        remote = self._remote.get(peer)
        if remote is None:
            raise PeerUnavailableError(f"no handshake with {peer}")
        pairs, their_blocks = self._plans[peer]
        mine, theirs = chunk_ids(pairs, local_ids, remote_ids, self.num_blocks, their_blocks)
        try:
            h = self.agent.make_prepped_xfer("READ", self._local, np.asarray(mine, np.int32),
                                             remote, np.asarray(theirs, np.int32))
        except Exception as e:
            raise PeerUnavailableError(f"cannot start a read from {peer}: {e}") from e
        finished = False
        try:
            self._wait(h, peer, len(remote_ids), deadline)
            finished = True
            if self.host is not None:
                self._stage_in(local_ids)
        except TransferError:
            raise
        except Exception as e:  # nixlRemoteDisconnectError and friends
            raise PeerUnavailableError(f"read from {peer} failed: {e}") from e
        finally:
            try:
                self.agent.release_xfer_handle(h)
            except Exception as e:  # an aborted read NIXL could not cancel: it owns the handle
                if not finished:
                    raise ReadInFlightError(
                        f"read of {len(remote_ids)} blocks from {peer} passed its deadline and "
                        f"could not be cancelled ({e}): its target blocks stay quarantined",
                        InFlightRead(self, h, peer, tuple(local_ids))) from e
                log.warning("releasing a read handle from %s: %s", peer, e)

    def _wait(self, h, peer: str, num_blocks: int, deadline: float) -> None:
        """Progress a READ until it is DONE (returns) or fails (raises)."""
        state = self.agent.transfer(h)
        # VRAM to VRAM is a DMA copy that ends within microseconds (16 MiB) to a fraction of a
        # millisecond (256 MiB on an H100): poll at once for its first half millisecond,
        # yielding the GIL between polls; then, as for DRAM reads (which UCX progresses in these
        # very polls), back off to at most 0.2 ms between them
        spin_until = time.monotonic() + (0.0005 if self.mem_type == "VRAM" else 0.0)
        pause = 0.0
        while state == "PROC":
            now = time.monotonic()
            if now > deadline:
                raise TransferDeadlineError(
                    f"read of {num_blocks} blocks from {peer} passed its deadline")
            if now < spin_until:
                time.sleep(0)
            else:
                time.sleep(pause)
                pause = min(0.0002, pause * 2 or 2e-5)
            state = self.agent.check_xfer_state(h)
        if state != "DONE":
            raise PeerUnavailableError(f"read from {peer} failed ({state})")

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._transports.path is not None and os.environ.get("BATON_UCX_LOG") == str(
                self._transports.path):
            self._transports.path.unlink(missing_ok=True)
        for name in list(self._remote):
            self.remove_peer(name)
        self.agent.release_dlist_handle(self._local)
        self.agent.deregister_memory(self._reg)


class InFlightRead:
    """A READ abandoned past its deadline that NIXL could not cancel: until it settles, its
    target blocks ``local_ids`` may still be written, so their owner keeps them out of use."""

    def __init__(self, agent: KVAgent, handle, peer: str, local_ids: tuple[int, ...]) -> None:
        self.agent, self.handle, self.peer, self.local_ids = agent, handle, peer, local_ids
        self._settled = False

    def settled(self) -> bool:
        """True once the READ reached a terminal state (done or failed) or its peer was removed,
        and its handle was given back. Cheap to poll; call from one thread."""
        if self._settled:
            return True
        if self.peer in self.agent._remote:
            try:
                state = self.agent.agent.check_xfer_state(self.handle)
            except Exception as e:  # NIXL no longer knows it: nothing can write any more
                log.info("in-flight read from %s: %s", self.peer, e)
                state = "ERR"
            if state == "PROC":
                return False
        try:
            self.agent.agent.release_xfer_handle(self.handle)
        except Exception as e:  # gone with its peer
            log.debug("releasing a settled read handle from %s: %s", self.peer, e)
        self._settled = True
        return True


def _runs(block_ids) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10] -> [(3, 6), (9, 11)]: half-open runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        b = int(b)
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs
