"""The prefill worker: an engine in the prefill role, holding finished prompts' KV under leases.

``python -m baton.services.prefill --help``. Serves ``PrefillWorker`` (Prefill, Info) and
``KVSource`` (Handshake, ReleaseLease) on one gRPC port; decode workers READ the leased blocks
over NIXL. Prints ``BATON_READY <address> <worker id> <incarnation>`` once it serves.
"""

from __future__ import annotations

import argparse

from baton.services.common.engine_loop import EngineLoop
from baton.services.common.prefill_role import add_prefill_role
from baton.services.common.worker import add_engine_args, add_server_args, boot_worker


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m baton.services.prefill",
        description="Baton prefill worker: computes prompts' KV and first token, and holds the "
                    "KV blocks under a lease until a decode worker has read them over NIXL.")
    add_engine_args(ap)
    add_server_args(ap)
    g = ap.add_argument_group("KV hand-off")
    g.add_argument("--lease-ttl", type=float, default=30.0,
                   help="seconds a prefilled request's blocks stay pinned for a reader "
                        "(default 30); an expired lease frees them and its reader is refused")
    g.add_argument("--max-leased-share", type=float, default=0.5,
                   help="refuse new prompts (RESOURCE_EXHAUSTED; the router tries another "
                        "worker or prefills locally) while this share of the KV pool waits "
                        "under leases for decode workers to read it (0: never) (default 0.5)")
    g.add_argument("--kv-checksums", action="store_true",
                   help="send per-block CRC32s in each handle for readers to verify (debugging)")
    args = ap.parse_args(argv)
    boot = boot_worker(args, "prefill")
    loop = EngineLoop(boot.engine)
    loop.on_outputs = boot.metrics.observe_outputs
    if not 0 <= args.max_leased_share <= 1:
        ap.error(f"--max-leased-share {args.max_leased_share}: must be in [0, 1]")
    holder = add_prefill_role(boot.server, loop, boot, args.lease_ttl, args.kv_checksums,
                              args.max_leased_share)
    loop.start()

    def stop() -> None:
        holder.shutdown()
        loop.stop()
        boot.agent.close()

    # a drain waits for the leased blocks' readers (their release calls need this server)
    boot.serve(args, ["baton.v1.PrefillWorker", "baton.v1.KVSource"], stop,
               busy=lambda: len(holder.leases) > 0)


if __name__ == "__main__":
    main()
