"""``python -m baton.services.decode``: a decode worker (see ``baton.services.worker.serve``)."""

from baton import adopt_launch_settings

adopt_launch_settings()  # before torch starts threads

from baton.services.worker.serve import decode_main  # noqa: E402 (after the settings above)

decode_main()
