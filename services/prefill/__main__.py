"""``python -m baton.services.prefill``: a prefill worker (see ``baton.services.worker.serve``)."""

from baton import adopt_launch_settings

adopt_launch_settings()  # before torch starts threads

from baton.services.worker.serve import prefill_main  # noqa: E402 (after the settings above)

prefill_main()
