"""The worker process: its boot, engine loop, roles (prefill, decode, both), Redis presence and
status reporting. ``python -m baton.services.prefill`` and ``python -m baton.services.decode``
start one (``serve``)."""
