"""KV-block transfer between engines (NIXL agents, leases, handles).

The engine side of a hand-off lives in :mod:`baton.engine.engine` (``prefill_only`` requests and
``reserve_handoff`` / ``commit_handoff``); this package will move those blocks between processes.
"""
