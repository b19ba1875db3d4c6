"""The prefill worker: an engine in the prefill role, holding finished prompts' KV under leases.

``python -m baton.services.prefill --help``. Serves ``PrefillWorker`` (Prefill, Info) and
``KVSource`` (Handshake, ReleaseLease) on one gRPC port; decode workers READ the leased blocks
over NIXL. Prints ``BATON_READY <address> <worker id> <incarnation>`` once it serves.
"""

from __future__ import annotations

from baton.services.common.config import HolderSettings, WorkerConfig, worker_parser
from baton.services.common.engine_loop import EngineLoop
from baton.services.common.prefill_role import add_prefill_role
from baton.services.common.worker import boot_worker


def main(argv: list[str] | None = None) -> None:
    ap, handoff = worker_parser(
        "python -m baton.services.prefill",
        "Baton prefill worker: computes prompts' KV and first token, and holds the KV blocks "
        "under a lease until a decode worker has read them over NIXL.")
    HolderSettings.add_flags(handoff, full=True)
    try:
        cfg = WorkerConfig.prefill(ap.parse_args(argv))
    except ValueError as e:
        ap.error(str(e))
    serve(cfg)


def serve(cfg: WorkerConfig) -> None:
    """Boot, serve until drained."""
    boot = boot_worker(cfg)
    loop = EngineLoop(boot.engine, fault_crash_after=cfg.fault_crash_engine_after,
                      fault_step_delay_s=cfg.fault_step_delay)
    loop.on_outputs = boot.metrics.observe_outputs
    holder = add_prefill_role(boot.server, loop, boot, cfg.holder)
    loop.start()

    def stop() -> None:
        holder.shutdown()
        loop.stop()
        boot.agent.close()

    # a drain waits for the leased blocks' readers (their release calls need this server)
    boot.serve(cfg.server, ["baton.v1.PrefillWorker", "baton.v1.KVSource"], stop,
               busy=lambda: len(holder.leases) > 0, died=loop.died)


if __name__ == "__main__":
    main()
