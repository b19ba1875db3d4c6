from baton import adopt_launch_settings

adopt_launch_settings()  # before torch starts threads

from baton.services.router.server import main  # noqa: E402 (after the settings above)

main()
