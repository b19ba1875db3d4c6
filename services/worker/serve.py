"""Starting a worker: its command line, and the serve loop of each role.

``python -m baton.services.prefill --help``: a prefill worker takes prompts (``PrefillWorker``)
and holds their KV for readers (``KVSource``: Handshake, ReleaseLease); decode workers READ the
leased blocks over NIXL. ``python -m baton.services.decode --help``: a decode worker streams
tokens (``DecodeWorker``: Decode, Generate); with ``--role both`` it prefills too. Every worker
serves all of these APIs and ``WorkerAdmin`` on one gRPC port, and takes new work of its current
role only, which ``baton role`` switches while it serves. Each prints ``BATON_READY <address>
<worker id> <incarnation>`` once it serves.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from baton.services.common.config import HolderSettings, WorkerConfig, worker_parser
from baton.services.common.faults import NONE as NO_FAULTS
from baton.services.common.faults import Faults
from baton.transfer.errors import TransferError

if TYPE_CHECKING:
    from baton.transfer.reader import KVReader

# the engine (torch), NIXL and gRPC load in serve_worker, after the command line is checked:
# `--help` and a bad flag answer in a fraction of a second, not after torch's ~2 s import
log = logging.getLogger("baton.services")


def prefill_main(argv: list[str] | None = None) -> None:
    ap, handoff = worker_parser(
        "python -m baton.services.prefill",
        "Baton prefill worker: computes prompts' KV and first token, and holds the KV blocks "
        "under a lease until a decode worker has read them over NIXL.")
    HolderSettings.add_flags(handoff, full=True)
    serve_worker(*_parse(ap, argv, WorkerConfig.prefill))


def decode_main(argv: list[str] | None = None) -> None:
    ap, g = worker_parser(
        "python -m baton.services.decode",
        "Baton decode worker: pulls a prefilled request's KV blocks over NIXL from the prefill "
        "worker named in its handle, then streams the generated tokens.")
    g.add_argument("--transfer-timeout", type=float, default=10.0,
                   help="deadline in seconds for one hand-off (handshake, read, lease release); "
                        "a dead or stalled prefill worker fails the request within it")
    g.add_argument("--peers", default="",
                   help="comma-separated prefill worker addresses to handshake with (and probe "
                        "with a one-block read) before reporting ready; a peer with another "
                        "model fingerprint makes this worker exit with an error")
    g.add_argument("--role", choices=["decode", "both"], default="decode",
                   help="both: also be a prefill worker (PrefillWorker and KVSource on the same "
                        "engine), for colocated pools (default decode)")
    HolderSettings.add_flags(g, full=False)  # --lease-ttl, for --role both
    serve_worker(*_parse(ap, argv, WorkerConfig.decode))


def _parse(ap, argv, config) -> tuple[WorkerConfig, Faults]:
    """The role's config (``config(args)``) and the faults to inject; a bad flag exits 2
    naming it."""
    try:
        a = ap.parse_args(argv)
        return config(a), Faults.from_args(a)
    except ValueError as e:
        ap.error(str(e))


def connect_peers(reader: KVReader, cfg: WorkerConfig) -> None:
    """Handshake with (and probe) every ``--peers`` prefill worker; exits 2 on a mismatch."""
    for peer in cfg.peers:
        try:
            transports = reader.connect(peer, time.monotonic() + cfg.transfer_timeout,
                                        probe_block=0)
        except TransferError as e:
            log.error("refusing to start: peer %s: %s", peer, e)
            raise SystemExit(2) from e
        log.info("peer %s ready; UCX transports in use: %s", peer, transports or "unknown")


def serve_worker(cfg: WorkerConfig, faults: Faults = NO_FAULTS) -> None:
    """Any role: the worker serves both worker APIs (PrefillWorker and KVSource, DecodeWorker)
    and WorkerAdmin, and takes new work of its current role only (services/worker/role.py), so
    `baton role` can switch it while it serves. A drain waits for the leased blocks' readers
    (their release calls need this server)."""
    from baton.services.worker.boot import boot_worker
    from baton.services.worker.decode_role import DecodeService
    from baton.services.worker.engine_loop import EngineLoop
    from baton.services.worker.prefill_role import add_prefill_role
    from baton.services.worker.role import AdminService, RoleGate
    from baton.transfer.reader import KVReader
    from baton.v1 import worker_pb2_grpc

    boot = boot_worker(cfg)
    gate = RoleGate(cfg.role)
    reader = KVReader(boot.agent, boot.engine.fingerprint, boot.worker_id,
                      faults.delay_release)
    connect_peers(reader, cfg)
    loop = EngineLoop(boot.engine, faults)
    loop.on_outputs = boot.metrics.observe_outputs
    holder = add_prefill_role(boot.server, loop, boot, cfg.holder or HolderSettings(), gate)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
        DecodeService(loop, reader, boot.worker_id, boot.incarnation, cfg.transfer_timeout,
                      holder, boot.metrics, gate), boot.server)
    worker_pb2_grpc.add_WorkerAdminServicer_to_server(
        AdminService(gate, boot.worker_id, lambda: boot.registration), boot.server)
    loop.start()

    def stop() -> None:
        holder.shutdown()
        loop.stop()
        reader.close()
        boot.agent.close()

    boot.serve(cfg.server, ["baton.v1.PrefillWorker", "baton.v1.KVSource",
                            "baton.v1.DecodeWorker", "baton.v1.WorkerAdmin"], stop,
               busy=lambda: len(holder.leases) > 0, died=loop.died)
